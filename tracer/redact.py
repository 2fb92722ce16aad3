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

import orjson

from tracer.record import TrajectoryRecord
from tracer.snapshot import Json, json_bytes

MARK = "[REDACTED]"

# name -> (cheap lowercase literals of which one must occur, regex). The literal check keeps
# the cost near a substring search for texts without secrets (one big alternation of all
# patterns measured 57 ms per 50 kB of prose here; these rules about 1 ms).
BUILTIN_PATTERNS: dict[str, tuple[tuple[str, ...], str]] = {
    "openai-key": (("sk-",), r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{16,}"),
    "wandb-key-assignment": (
        ("wandb",),
        r"(?i:\b(?:wandb[_\- ]?api[_\- ]?key|wandb_key)\s*"
        r"[=:]\s*['\"]?[A-Za-z0-9_\-]{20,})",
    ),
    # 40 lower-case hex digits (a W&B key) only after "wandb" or "api key" on the same line,
    # within 40 characters ("wandb login 0123...", "api_key: 0123..."): a bare run of 40 hex
    # digits is far more often a git commit or a checksum (benchmarks/bench_redact.py)
    "wandb-key": (
        ("wandb", "api_key", "api key", "api-key", "apikey"),
        r"((?i:wandb|api[_\- ]?key)[^\n]{0,40}?)(?<![0-9A-Za-z])[0-9a-f]{40}(?![0-9A-Za-z])",
    ),
    "aws-access-key": (("akia", "asia"), r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "aws-secret": (
        ("aws_secret_access_key",),
        r"(?i:aws_secret_access_key\s*[=:]\s*['\"]?[A-Za-z0-9/+=]{30,})",
    ),
    "bearer": (("bearer",), r"(?i:\bbearer\s+[A-Za-z0-9._~+/=\-]{8,})"),
    "hf-token": (("hf_",), r"\bhf_[A-Za-z0-9]{20,}"),
    # GitHub: classic personal, OAuth, user-to-server, server-to-server, refresh; fine-grained
    "github-token": (
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
        r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b",
    ),
    "github-fine-grained": (("github_pat_",), r"\bgithub_pat_[A-Za-z0-9_]{22,255}"),
    "gcp-api-key": (("aiza",), r"\bAIza[0-9A-Za-z_\-]{35}"),
    "slack-token": (("xox",), r"\bxox[baprs]-[0-9A-Za-z\-]{10,}"),
    "slack-webhook": (
        ("hooks.slack.com",),
        r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/_\-]{20,}",
    ),
    "jwt": (("eyj",), r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"),
    # PEM private keys (a GCP service account's JSON holds one): to the END line or the text's
    # end when it was cut
    "private-key": (
        ("private key",),
        r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)",
    ),
    "stripe-key": (("_live_", "_test_"), r"\b(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{24,}"),
}
_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET", re.IGNORECASE)
_NUMBERS = frozenset({int, float, bool, type(None)})
_MIN_SECRET = 8  # shorter env values ("1", "true") would redact half of every text


def secret_env_values() -> list[str]:
    return sorted(
        {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_SECRET},
        key=len,
        reverse=True,
    )


# Rules whose regex is case-sensitive: a string they change holds one of these literals as
# written, so the serialized-record gate looks for them so
_AS_WRITTEN = {"aws-access-key": ("AKIA", "ASIA"), "hf-token": ("hf_",), "openai-key": ("sk-",),
               "github-token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
               "github-fine-grained": ("github_pat_",), "gcp-api-key": ("AIza",),
               "slack-token": ("xox",), "jwt": ("eyJ",),
               "private-key": ("PRIVATE KEY",)}  # fmt: skip
# Bytes common in records (token ids, English text, our own JSON keys): anchors of last resort
_COMMON = frozenset(b' ,0123456789":etaoinsrlhcdumpf_.{}[]bhOKTUYPL')
_LESS_COMMON = b"kyvxgwjqz-"  # from more to less common; a byte in neither is rarer still
# Past this many false hits of its anchor a gate searches for its literal instead: each hit
# costs a Python step, about what ``re`` takes to search a few kB
_MAX_ANCHOR_HITS = 8
_SEARCH_ONLY_CALLS = 256  # a gate whose literal has no rare byte searches this long, then looks
# JSON's punctuation and digits, in no built-in literal: the gates look at a line without them
# (a record's token ids and timestamps are most of its bytes); a literal there is still whole
_NOT_IN_LITERALS = b'0123456789,":{}[]'


def _static_order(literal: bytes) -> list[int]:
    """The indices of ``literal``'s distinct bytes, from the rarest in records to the most
    common (by the tables above)."""
    order = {b: rank for rank, b in enumerate(_LESS_COMMON)}
    first = {b: i for i, b in reversed(list(enumerate(literal)))}
    return sorted(first.values(), key=lambda i: (literal[i] in _COMMON,
                                                 -order.get(literal[i], len(_LESS_COMMON))))


class _Gate:
    """Whether a literal occurs in a record's line: through one of its bytes, the one rarest
    in the records seen (one byte is found at memchr speed, while a search for several
    compares at nearly every position), else by ``search`` (the literal as a compiled regex:
    ``re`` finds a literal about twice as fast as ``bytes.__contains__`` here). The choice only
    changes the cost: every way gives the same answer (so two threads may share a gate)."""

    __slots__ = ("at", "literal", "order", "search", "searches_left")

    def __init__(self, literal: bytes, search: Any, anchored: bool = True) -> None:
        self.literal = literal
        self.search = search
        self.order = _static_order(literal) if anchored else []  # empty: search only
        rare = [i for i in self.order if literal[i] not in _COMMON]
        self.at: int | None = rare[0] if rare else None
        self.searches_left = _SEARCH_ONLY_CALLS

    def __call__(self, data: bytes) -> bool:
        at = self.at
        if at is None:
            if self.order:
                self.searches_left -= 1
                if self.searches_left <= 0:
                    self._choose(data)
            return self.search(data) is not None
        literal = self.literal
        anchor = literal[at]
        pos = data.find(anchor)
        hits = 0
        while pos >= 0:
            start = pos - at
            if start >= 0 and data.startswith(literal, start):
                return True
            hits += 1
            if hits > _MAX_ANCHOR_HITS:
                self._choose(data)
                return self.search(data) is not None
            pos = data.find(anchor, pos + 1)
        return False

    def _choose(self, data: bytes) -> None:
        """Anchor on the literal's byte that is rarest in ``data`` (a record like the next
        ones); none when even that one is common: search, and look again later."""
        literal = self.literal
        counts = [(data.count(literal[i]), i) for i in self.order]
        hits, at = min(counts)
        self.at = at if hits <= _MAX_ANCHOR_HITS else None
        self.searches_left = _SEARCH_ONLY_CALLS


def _gates(literals: list[bytes]) -> tuple[_Gate, ...]:
    """The gates of ``literals``: one each, except that literals sharing their first two bytes
    (``ghp_`` ... ``ghr_``, the four ``api key`` spellings) are one search for any of them (a
    regex alternation, which ``re`` reduces to the shared prefix and a class: one pass over
    the record instead of five); a literal listed twice is looked for once."""
    groups: dict[bytes, list[bytes]] = {}
    for lit in dict.fromkeys(literals):
        groups.setdefault(lit[:2], []).append(lit)
    out: list[_Gate] = []
    for group in groups.values():
        if len(group) == 1:
            out.append(_Gate(group[0], re.compile(re.escape(group[0])).search))
        else:
            either = b"|".join(re.escape(lit) for lit in sorted(group))
            out.append(_Gate(b"", re.compile(either).search, anchored=False))
    return tuple(out)


class Redactor:
    def __init__(
        self,
        patterns: list[str],
        callback: Callable[[str], str] | None = None,
        builtin: bool = True,
    ) -> None:
        self.rules: list[tuple[tuple[str, ...], re.Pattern[str], Any]] = []
        if builtin:
            self.rules = [
                (lits, re.compile(rx), r"\g<1>" + MARK if name == "wandb-key" else MARK)
                for name, (lits, rx) in BUILTIN_PATTERNS.items()
            ]
        for p in patterns:
            try:
                self.rules.append(((), re.compile(p), MARK))
            except re.error as exc:
                raise ValueError(f"invalid redact pattern {p!r}: {exc}") from exc
        self.literals = secret_env_values() if builtin else []
        self.callback = callback
        # what the serialized-record gate (``needs``) looks for; user patterns and a callback
        # can match anything, so they always take the per-field path
        self._always = bool(patterns) or callback is not None
        builtins = BUILTIN_PATTERNS.items() if builtin else ()
        self._gate_lower = _gates(
            [lit.encode() for name, (lits, _rx) in builtins if name not in _AS_WRITTEN
             for lit in lits]
        )  # fmt: skip
        exact = [lit.encode() for lits in _AS_WRITTEN.values() for lit in lits] if builtin else []
        self._gate_exact = _gates(exact)
        # a secret's value may hold digits or punctuation: looked for in the whole line
        self._gate_env = _gates([orjson.dumps(v)[1:-1] for v in self.literals])  # as in JSON

    def needs(self, data: bytes) -> bool:
        """Whether a record serialized as ``data`` (its JSON) may hold something to redact. A
        superset test at C speed: every string a rule would change in the record shows, in
        its JSON, the rule's literal (in lower case, where the per-field pass looks for it;
        as written, where the rule's regex is case-sensitive) or a secret's JSON-escaped
        value. False means the per-field pass would change nothing."""
        if self._always:
            return True
        if any(gate(data) for gate in self._gate_env):
            return True
        words = data.translate(None, _NOT_IN_LITERALS)
        if any(gate(words) for gate in self._gate_exact):
            return True
        # str.lower maps a few non-ASCII letters to ASCII ones (the Kelvin sign to k)
        low = words.lower() if words.isascii() else words.decode().lower().encode()
        return any(gate(low) for gate in self._gate_lower)

    def text(self, s: str) -> str:
        if len(s) >= _MIN_SECRET:
            low = s.lower()
            for literals, regex, repl in self.rules:
                if not literals or any(lit in low for lit in literals):
                    s = regex.sub(repl, s)
            for value in self.literals:
                if value in s:
                    s = s.replace(value, MARK)
        if self.callback is not None:
            s = str(self.callback(s))
        return s

    def value(self, x: Any, memo: dict[int, str] | None = None) -> Any:
        # Strings and scalars inside containers are handled in the loop, without a call per
        # value: a traced rollout's record holds a few hundred of them.
        if type(x) is Json:  # the hot path's encoding of plain data
            data = json_bytes(x)
            if not self.needs(data):  # nothing in it to change: its bytes stay as they are
                return x
            x = orjson.loads(data)  # redacted as its values
        if isinstance(x, str):
            return self._str(x, memo)
        if isinstance(x, list):
            # token ids, masks, log-probs: no string inside, so nothing to redact; the item
            # types are collected at C speed (walking a 1,000-id list item by item was 40% of
            # the background's processing time for a traced rollout)
            if not x or set(map(type, x)) <= _NUMBERS:
                return x
            return [self._str(v, memo) if type(v) is str else self.value(v, memo) for v in x]
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                tv = type(v)
                if tv is str:
                    out[k] = self._str(v, memo)
                elif tv in _NUMBERS:
                    out[k] = v
                else:
                    out[k] = self.value(v, memo)
            return out
        return x

    def _str(self, s: str, memo: dict[int, str] | None) -> str:
        if len(s) < _MIN_SECRET and self.callback is None:
            return s  # too short to hold a secret, and no callback to see it
        if memo is None:
            return self.text(s)
        done = memo.get(id(s))
        if done is None:  # the root shows its first child's inputs: same strings
            done = memo[id(s)] = self.text(s)
        return done

    def record(self, record: TrajectoryRecord) -> TrajectoryRecord:
        memo: dict[int, str] = {}
        keep = []  # keep the originals alive so their ids are not reused within this record
        record.attributes = self.value(record.attributes, memo)
        for span in record.spans:
            keep.append((span.inputs, span.outputs, span.attributes, span.error))
            span.inputs = self.value(span.inputs, memo)
            span.outputs = self.value(span.outputs, memo)
            span.attributes = self.value(span.attributes, memo)
            if span.error is not None:
                span.error = self.value(span.error, memo)
        return record
