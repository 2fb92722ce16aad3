"""Which source wins (docs/configuration.md#where-options-come-from), for every source and
every kind of field, through the one function that decides (tracer.config_sources.
resolve_config): what the code gives, even a value equal to the default; then the
ROLLOUT_TRACER_<FIELD> variable; then the file $ROLLOUT_TRACER_CONFIG; then the default."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer.config import TraceConfig, _default_worker_id
from tracer.config_sources import resolve_config
from tracer.record import read_jsonl


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    tracer.reset()
    yield
    tracer.reset()


# field, its kind, the file's YAML, the variable's text, the variable's value, the code's value
# (most equal the default: the code still wins). A boolean has two values, so its two rows
# share the checks: redact's variable beats its file, spool's the default, and the code's
# default beats both.
ROWS = [
    ("redact", "bool", "false", "yes", True, True),
    ("spool", "bool", "no", "off", False, True),
    ("export_batch_size", "int", "11", "64", 64, 256),
    ("keep_max_per_step", "int | None", "3", "5", 5, None),
    ("flush_interval_s", "float", "0.5", "0.25", 0.25, 1.0),
    ("stuck_after_s", "float", "30", "0", 0.0, 600.0),
    ("worker_id", "str", "from-file", "from-env", "from-env", _default_worker_id()),
    ("on_backend_error", "enum", "warn", "raise", "raise", "raise"),
    ("tracking_uri", "str | None", "sqlite:///f.db", "sqlite:///e.db", "sqlite:///e.db", None),
    ("export_in_subprocess", "bool | None", "true", "false", False, None),
    ("keep", "list", "[errors]", "tool_errors,truncated", ["tool_errors", "truncated"], []),
    ("otlp_headers", "dict", "{a: '1'}", '{"b": "2"}', {"b": "2"}, {}),
]


def _file(tmp_path: Path, field: str, text: str) -> dict[str, str]:
    path = tmp_path / "trace.yaml"
    path.write_text(f"{field}: {text}\n")
    return {"ROLLOUT_TRACER_CONFIG": str(path)}


def _file_value(field: str, text: str, tmp_path: Path) -> Any:
    return getattr(resolve_config({"backend": None}, environ=_file(tmp_path, field, text)), field)


@pytest.mark.parametrize(("field", "kind", "file_text", "env_text", "env_value", "code"), ROWS,
                         ids=[f"{r[0]}:{r[1]}" for r in ROWS])  # fmt: skip
def test_every_source_in_its_order(
    tmp_path: Path, field: str, kind: str, file_text: str, env_text: str, env_value: Any,
    code: Any,
) -> None:  # fmt: skip
    default = getattr(TraceConfig(backend=None), field)
    if field == "worker_id":
        assert default == code  # the code gives exactly what the default would be
    env_only = {f"ROLLOUT_TRACER_{field.upper()}": env_text}
    file_only = _file(tmp_path, field, file_text)
    both = {**file_only, **env_only}

    def resolved(config: Any, environ: dict[str, str], **overrides: Any) -> Any:
        return getattr(resolve_config(config, overrides, environ), field)

    file_value = _file_value(field, file_text, tmp_path)
    assert file_value != default or env_value != default  # the row tells sources apart
    assert resolved({"backend": None}, {}) == default
    assert resolved({"backend": None}, file_only) == file_value
    assert resolved({"backend": None}, env_only) == env_value
    assert resolved({"backend": None}, both) == env_value  # a variable beats the file
    for environ in (file_only, env_only, both):
        # the code wins, however it says it, even with the default's value
        assert resolved({"backend": None, field: code}, environ) == code
        assert resolved({"backend": None}, environ, **{field: code}) == code
        assert resolved(TraceConfig(backend=None, **{field: code}), environ) == code
        assert resolved(TraceConfig(backend=None), environ, **{field: code}) == code
        assert resolved(TraceConfig(backend=None, **{field: code}).with_values(), environ) == code
    # a TraceConfig that leaves the field out is filled, a copy of it too
    assert resolved(TraceConfig(backend=None), both) == env_value
    assert resolved(TraceConfig(backend=None).with_values(sampling_seed=1), both) == env_value


def test_the_issues_case_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """redact=True and spool=True in code against REDACT=0 and a file saying redact: false:
    the stored trajectory is redacted and the spool is on; the code's export_batch_size=256
    (the default) is kept against the file's 11."""
    path = tmp_path / "shared.yaml"
    path.write_text("redact: false\nspool: false\nexport_batch_size: 11\n")
    monkeypatch.setenv("ROLLOUT_TRACER_CONFIG", str(path))
    monkeypatch.setenv("ROLLOUT_TRACER_REDACT", "0")
    out = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(out), redact=True, spool=True,
                export_batch_size=256, spool_dir=str(tmp_path / "spool"))  # fmt: skip
    config = tracer.get_tracer().config
    assert (config.redact, config.spool, config.export_batch_size) == (True, True, 256)

    @tracer.trace_op(kind="tool")
    def call(token: str) -> str:
        return "ok"

    secret = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8s9T0"
    with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
        call(secret)
    assert tracer.flush(30)
    assert secret not in out.read_text()
    assert [r.step for r in read_jsonl(str(out))] == [0]


def test_a_stray_variable_is_one_warning_and_a_misspelling_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tracer.config import ConfigError

    caplog.set_level(logging.WARNING, logger="tracer")
    for name in ("ROLLOUT_TRACER_HOME", "ROLLOUT_TRACER_LOG_LEVEL"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("ROLLOUT_TRACER_VERL", "0")  # the switch: known, silent
    for _ in range(3):
        tracer.init(backend="memory")
        tracer.reset()
    lines = [r.getMessage() for r in caplog.records if "ROLLOUT_TRACER_" in r.getMessage()]
    assert sorted(line.split()[2] for line in lines) == [
        "ROLLOUT_TRACER_HOME:", "ROLLOUT_TRACER_LOG_LEVEL:"]  # once each  # fmt: skip
    monkeypatch.setenv("ROLLOUT_TRACER_REDACTT", "0")
    with pytest.raises(ConfigError, match=r"ROLLOUT_TRACER_REDACTT \(did you mean "
                                          r"`ROLLOUT_TRACER_REDACT`"):  # fmt: skip
        tracer.init(backend="memory")
