"""Secrets never leave the process: every built-in pattern, env values, user patterns and a
callback, checked in what the MLflow store and the JSONL file really hold."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests.conftest import search_traces

SECRETS = {
    "openai": "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789",
    "wandb": "WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "aws_secret": "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "bearer": "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig",
    "hf": "hf_abcdefghijklmnopqrstuvwxyz",
}


def _trace_secrets(env_secret: str) -> None:
    @tracer.trace_op(kind="tool")
    def call_api(prompt: str, headers: dict[str, str], env: Any) -> str:
        return f"echo {prompt} with {headers['auth']} and {env_secret}"

    with tracer.trace_attr(step=1, sample_index=0):
        call_api(
            "my key is " + SECRETS["openai"] + " " + SECRETS["wandb"],
            {
                "auth": SECRETS["bearer"],
                "aws": SECRETS["aws"] + " " + SECRETS["aws_secret"],
                "hf": SECRETS["hf"],
                "custom": "ticket-98765",
                "env": env_secret,
            },
            os.environ,
        )


def _otlp_memory() -> Any:
    """The OTLP exporter with the OTel SDK's in-memory span exporter in place of HTTP: exactly
    the spans that would be sent to a collector."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracer.backends import register_backend
    from tracer.backends.otlp_backend import OtlpExporter

    memory = InMemorySpanExporter()
    register_backend("otlp-memory", lambda config: OtlpExporter(config, span_exporter=memory))
    return memory


@pytest.mark.parametrize("backend", ["mlflow", "jsonl", "otlp", "weave"])
def test_every_pattern_is_redacted_in_backend_output(
    backend: str, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
):
    env_secret = "s3cr3t-value-from-the-env"
    monkeypatch.setenv("MY_SERVICE_TOKEN", env_secret)
    jsonl = tmp_path / "t.jsonl"
    sink: Any = None
    if backend == "otlp":
        sink, backend = _otlp_memory(), "otlp-memory"
    elif backend == "weave":
        sink = request.getfixturevalue("weave_server")
    tracer.init(
        weave_entity="team",
        backend=backend,
        tracking_uri=mlflow_uri,
        jsonl_path=str(jsonl),
        project_name="redact",
        redact_patterns=[r"ticket-\d+"],
        redact_callback=lambda s: s.replace("echo", "ECHO"),
        raise_internal_errors=True,
    )
    _trace_secrets(env_secret)
    assert tracer.flush(60)
    if backend == "mlflow":
        [trace] = search_traces(mlflow_uri, "redact")
        stored = trace.to_json()
    elif backend == "otlp-memory":
        spans = [dict(s.attributes or {}) for s in sink.get_finished_spans()]
        stored = json.dumps(spans, ensure_ascii=False)
        assert "call_api" in json.dumps([s.name for s in sink.get_finished_spans()])
    elif backend == "weave":
        tracer.reset()  # the weave client sends from its own threads: finish them
        stored = json.dumps(sink.calls(), ensure_ascii=False, default=str)
        assert "call_api" in stored  # the spans did arrive
    else:
        stored = jsonl.read_text()
    for name, secret in SECRETS.items():
        core = secret.split()[-1].split("=")[-1]
        assert core not in stored, f"{name} leaked"
    assert env_secret not in stored and "ticket-98765" not in stored
    assert "[REDACTED]" in stored
    assert "ECHO" in stored  # the user callback ran
    assert "environment variables: never captured" in stored
    assert os.environ.get("PATH", "") not in stored  # the environment itself is not captured


def test_redaction_can_be_turned_off_and_bad_pattern_is_a_config_error(tmp_path: Path):
    with pytest.raises(tracer.ConfigError, match="invalid redact pattern"):
        tracer.init(backend="memory", redact_patterns=["(unclosed"])
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), redact=False)
    with tracer.trace_attr(step=0, sample_index=0):
        pass

    @tracer.trace_op(kind="tool")
    def tool(x: str) -> str:
        return x

    with tracer.trace_attr(step=0, sample_index=1):
        tool(SECRETS["openai"])
    assert tracer.flush(30)
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert any(SECRETS["openai"] in json.dumps(r) for r in lines)


def test_no_builtin_literal_holds_what_the_gate_strips() -> None:
    """The serialized-record gate looks at a line without digits and JSON punctuation
    (``_NOT_IN_LITERALS``): a built-in literal holding one of those bytes would never be seen
    there, and its secrets would go unredacted. Adding such a literal must fail here."""
    from tracer.redact import _AS_WRITTEN, _NOT_IN_LITERALS, BUILTIN_PATTERNS

    literals = [lit for lits, _rx in BUILTIN_PATTERNS.values() for lit in lits]
    literals += [lit for lits in _AS_WRITTEN.values() for lit in lits]
    assert literals
    for lit in literals:
        assert not set(lit.encode()) & set(_NOT_IN_LITERALS), lit
        assert not set(lit.lower().encode()) & set(_NOT_IN_LITERALS), lit
