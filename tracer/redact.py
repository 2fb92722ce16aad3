"""Redaction of secrets in finished records: a processor stage, never on the hot path.

Built-in patterns cover OpenAI-style keys (``sk-...``), W&B keys, AWS keys, bearer tokens and
the literal value of every environment variable whose name contains KEY, TOKEN or SECRET.
Users add regexes (``redact_patterns``) and a callback (``redact_callback(text) -> text``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from tracer.record import TrajectoryRecord

MARK = "[REDACTED]"

BUILTIN_PATTERNS: dict[str, str] = {
    "openai-key": r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{16,}",
    "wandb-key": r"(?i:\b(?:wandb[_\- ]?api[_\- ]?key|wandb_key)\s*[=:]\s*['\"]?"
    r"[A-Za-z0-9_\-]{20,})|\b(?:local-)?[0-9a-f]{40}\b",
    "aws-access-key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "aws-secret": r"(?i:aws_secret_access_key\s*[=:]\s*['\"]?[A-Za-z0-9/+=]{30,})",
    "bearer": r"(?i:\bbearer\s+[A-Za-z0-9._~+/=\-]{8,})",
    "hf-token": r"\bhf_[A-Za-z0-9]{20,}",
}
_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET", re.IGNORECASE)
_MIN_ENV_SECRET = 8  # shorter values ("1", "true") would redact half of every text


def secret_env_values() -> list[str]:
    return sorted(
        {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_ENV_SECRET},
        key=len,
        reverse=True,
    )


class Redactor:
    def __init__(
        self,
        patterns: list[str],
        callback: Callable[[str], str] | None = None,
        builtin: bool = True,
    ) -> None:
        parts = list(BUILTIN_PATTERNS.values()) if builtin else []
        parts += [re.escape(v) for v in secret_env_values()] if builtin else []
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"invalid redact pattern {p!r}: {exc}") from exc
            parts.append(p)
        self.regex = re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None
        self.callback = callback

    def text(self, s: str) -> str:
        if self.regex is not None:
            s = self.regex.sub(MARK, s)
        if self.callback is not None:
            s = str(self.callback(s))
        return s

    def value(self, x: Any) -> Any:
        if isinstance(x, str):
            return self.text(x)
        if isinstance(x, list):
            return [self.value(v) for v in x]
        if isinstance(x, dict):
            return {k: self.value(v) for k, v in x.items()}
        return x

    def record(self, record: TrajectoryRecord) -> TrajectoryRecord:
        record.attributes = self.value(record.attributes)
        for span in record.spans:
            span.inputs = self.value(span.inputs)
            span.outputs = self.value(span.outputs)
            span.attributes = self.value(span.attributes)
            if span.error is not None:
                span.error = self.value(span.error)
        return record
