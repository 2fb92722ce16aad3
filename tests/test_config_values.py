"""Every value, from every source, is checked when the TraceConfig is made, and the error names
where the value came from: ``TraceConfig(x=...)``, the variable, or ``file PATH:key``
(docs/configuration.md#mistakes-fail-loudly, docs/api.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tracer.backends import register_backend
from tracer.config import ConfigError, TraceConfig
from tracer.config_sources import resolve_config
from tracer.config_values import TEXT_FALSE, TEXT_TRUE
from tracer.testing import InMemoryExporter


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "nope"}, r"TraceConfig\(backend=...\): unknown trace backend.*'jsonl'"),
        ({"bogus": 1}, r"TraceConfig\(bogus=...\): unknown option; valid: annotation_timeout_s"),
        ({"spool_dri": "/x"}, r"did you mean `spool_dir`\?; also close: `spool`"),
        ({"stuck_after_s": "abc"}, r"TraceConfig\(stuck_after_s=...\): .*number"),
        ({"redact": "no"}, r"TraceConfig\(redact=...\): redact must be True or False"),
        ({"spool": 1}, r"spool must be True or False"),
        ({"export_timeout_s": float("nan")}, r"export_timeout_s must be a finite number"),
        ({"shutdown_timeout_s": float("inf")}, r"shutdown_timeout_s must be a finite number"),
        ({"shutdown_timeout_s": -1}, r"shutdown_timeout_s must be >= 0"),
        ({"replay_interval_s": 0}, r"replay_interval_s must be > 0"),
        ({"flush_interval_s": 0.0}, r"flush_interval_s must be > 0"),
        ({"export_batch_size": 0}, r"export_batch_size must be a positive integer"),
        ({"export_max_retries": -1}, r"export_max_retries must be an integer >= 0"),
        ({"max_samples_per_step_per_worker": True}, r"must be an integer"),
        ({"keep": ["erors"]}, r"TraceConfig\(keep=...\): unknown keep rule 'erors'"),
        ({"on_backend_error": "ignore"}, r"on_backend_error must be one of 'raise', 'warn'"),
        ({"otlp_headers": "x=1"}, r"otlp_headers must be a mapping"),
        ({"tracking_uri": 5}, r"tracking_uri must be a string"),
        ({"redact_callback": "strip"}, r"redact_callback must be a callable"),
        ({"redact_patterns": ["("]}, r"TraceConfig\(redact_patterns=...\): invalid redact"),
    ],
)
def test_code_values_are_checked_when_made(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TraceConfig(**options)


@pytest.mark.parametrize(
    ("var", "text", "message"),
    [
        ("EXPORT_TIMEOUT_S", "nan", "must be a finite number"),
        ("EXPORT_TIMEOUT_S", "inf", "must be a finite number"),
        ("EXPORT_TIMEOUT_S", "soon", "could not convert"),
        ("SHUTDOWN_TIMEOUT_S", "-1", "must be >= 0"),
        ("REPLAY_INTERVAL_S", "0", "must be > 0"),
        ("SPOOL", "maybe", "not a boolean"),
        ("REDACT", "nein", "not a boolean"),
        ("MAX_LIST_ITEMS", "0", "must be a positive integer"),
        ("KEEP", "erors", "unknown keep rule"),
        ("ON_BACKEND_ERROR", "ignore", "must be one of"),
        ("OTLP_HEADERS", "[1]", "not a JSON object"),
    ],
)
def test_a_variable_is_named_with_its_value(var: str, text: str, message: str) -> None:
    name = f"ROLLOUT_TRACER_{var}"
    with pytest.raises(ConfigError, match=re.escape(name) + ".*" + message):
        resolve_config({"backend": None}, environ={name: text})


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("flush_interval_s: fast", "could not convert"),
        ("export_timeout_s: soon", "could not convert"),
        ("export_timeout_s: .nan", "must be a finite number"),
        ("spool: maybe", "not a boolean"),
        ("redact: 2", "must be True or False"),
        ("max_field_chars: -1", "must be a positive integer"),
        ("keep: [erors]", "unknown keep rule"),
        ("otlp_conventions: [zipkin]", "unknown OTLP convention"),
        ("spool_dri: /x", "unknown option.*did you mean `spool_dir`"),
        ("backend: jsonl", "not read from a file"),
    ],
)
def test_a_file_key_is_named_with_the_file(tmp_path: Path, yaml: str, message: str) -> None:
    path = tmp_path / "trace.yaml"
    path.write_text(yaml + "\n")
    key = yaml.split(":")[0]
    with pytest.raises(ConfigError, match=re.escape(f"file {path}:{key}") + ".*" + message):
        resolve_config({"backend": None}, environ={"ROLLOUT_TRACER_CONFIG": str(path)})


def test_the_accepted_spellings_of_a_boolean(tmp_path: Path) -> None:
    """Text (a variable, a quoted string in the file) says a boolean in these spellings, any
    case; code says True or False."""
    assert TEXT_TRUE == ("1", "true", "yes", "on") and TEXT_FALSE == ("0", "false", "no", "off")
    for text, value in [*((t, True) for t in TEXT_TRUE), *((t, False) for t in TEXT_FALSE)]:
        for spelled in (text, text.upper()):
            env = {"ROLLOUT_TRACER_SPOOL": spelled}
            assert resolve_config({"backend": None}, environ=env).spool is value
    path = tmp_path / "trace.yaml"
    path.write_text("redact: 'no'\nspool: 'On'\n")  # quoted: strings, read as text
    config = resolve_config({"backend": None}, environ={"ROLLOUT_TRACER_CONFIG": str(path)})
    assert (config.redact, config.spool) == (False, True)


def test_a_registered_backend_is_valid_when_made() -> None:
    name = "registered-for-test-config-values"
    with pytest.raises(ConfigError, match="unknown trace backend"):
        TraceConfig(backend=name)
    register_backend(name, InMemoryExporter)
    assert TraceConfig(backend=[name, "memory"]).backends == [name, "memory"]


def test_what_the_code_said_is_kept_by_position_and_keyword() -> None:
    assert TraceConfig().said == frozenset()
    assert TraceConfig("memory", redact=True).said == {"backend", "redact"}
    assert TraceConfig(backend=None).with_values(spool=True).said == {"backend", "spool"}
