"""rollout-tracer's own options for processes that get no arguments (verl's Ray workers):
``ROLLOUT_TRACER_<FIELD>`` variables and the ``$ROLLOUT_TRACER_CONFIG`` file, as the switch
reads them (tracer/verl_switch.py: switch_options). The switch itself runs against an
installed verl in tests/test_verl_installed.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import tracer
from tracer.config import ConfigError
from tracer.config_sources import options_from_env
from tracer.verl_switch import VERL_DEFAULT_TRACKING_URI, enabled, switch_options


def test_variables_become_typed_options() -> None:
    env = {
        "ROLLOUT_TRACER_SPOOL_DIR": "/data/spool",
        "ROLLOUT_TRACER_KEEP": "errors, tool_errors",
        "ROLLOUT_TRACER_KEEP_MAX_PER_STEP": "4",
        "ROLLOUT_TRACER_FLUSH_INTERVAL_S": "0.5",
        "ROLLOUT_TRACER_REDACT": "false",
        "ROLLOUT_TRACER_RUN_SALT": "none",
        "ROLLOUT_TRACER_OTLP_HEADERS": '{"x-team": "rl"}',
        "ROLLOUT_TRACER_VERL": "1",  # the switch and the model cache are not options
        "ROLLOUT_TRACER_CACHE": "/cache",
        "PATH": "/usr/bin",
    }
    options = options_from_env(env)
    assert options == {
        "spool_dir": "/data/spool", "keep": ["errors", "tool_errors"], "keep_max_per_step": 4,
        "flush_interval_s": 0.5, "redact": False, "run_salt": None,
        "otlp_headers": {"x-team": "rl"},
    }  # fmt: skip
    config = tracer.TraceConfig(backend=None, **options)  # every value has the field's type
    assert config.keep == ["errors", "tool_errors"] and config.redact is False


def test_a_file_and_variables_that_win_over_it(tmp_path: Path) -> None:
    path = tmp_path / "trace.yaml"
    path.write_text("spool_dir: /from/file\nkeep: [errors]\nmax_field_chars: 1000\n")
    env = {"ROLLOUT_TRACER_CONFIG": str(path), "ROLLOUT_TRACER_SPOOL_DIR": "/from/env"}
    assert options_from_env(env) == {"spool_dir": "/from/env", "keep": ["errors"],
                                     "max_field_chars": 1000}  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ROLLOUT_TRACER_SPOL_DIR": "/x"}, "did you mean `ROLLOUT_TRACER_SPOOL_DIR`"),
        ({"ROLLOUT_TRACER_BACKEND": "weave"}, "ROLLOUT_TRACER_BACKEND is not read"),
        ({"ROLLOUT_TRACER_REDACT": "maybe"}, "ROLLOUT_TRACER_REDACT='maybe'"),
        ({"ROLLOUT_TRACER_MAX_FIELD_CHARS": "lots"}, "ROLLOUT_TRACER_MAX_FIELD_CHARS"),
        ({"ROLLOUT_TRACER_CONFIG": "/no/such/file.yaml"}, "cannot read ROLLOUT_TRACER_CONFIG"),
        ({"ROLLOUT_TRACER_REDACT": "no"}, None),  # a boolean's spelling: accepted
        ({"ROLLOUT_TRACER_HOME": "/home/x"}, None),  # someone else's variable: a warning
    ],
)
def test_mistakes_are_named(env: dict[str, str], message: str | None) -> None:
    if message is None:
        options_from_env(env)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        options_from_env(env)


def test_unknown_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.yaml"
    path.write_text("spool_dri: /x\n")
    with pytest.raises(ConfigError, match="did you mean `spool_dir`"):
        options_from_env({"ROLLOUT_TRACER_CONFIG": str(path)})


def test_the_switch_setting_and_verls_default_store() -> None:
    assert [enabled({"ROLLOUT_TRACER_VERL": v}) for v in ("1", "true", " ON ", "0", "", "no")] \
        == [True, True, True, False, False, False]  # fmt: skip
    assert not enabled({})
    assert switch_options({})["tracking_uri"] == VERL_DEFAULT_TRACKING_URI
    assert "tracking_uri" not in switch_options({"MLFLOW_TRACKING_URI": "http://m:5000"})
    ours = {"ROLLOUT_TRACER_TRACKING_URI": "sqlite:///x.db", "MLFLOW_TRACKING_URI": "http://m"}
    assert switch_options(ours)["tracking_uri"] == "sqlite:///x.db"


def test_export_in_subprocess_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, mlflow_uri: str, tmp_path: Path
) -> None:
    """``ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS`` decides when the argument is None (the test
    suite sets it to false: tests/conftest.py); an argument wins; a bad value fails init."""
    from tracer.config import TraceConfig
    from tracer.config_sources import resolve_export_in_subprocess

    var = "ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS"
    default = TraceConfig(backend=None)
    assert resolve_export_in_subprocess(default, {}) is None
    assert resolve_export_in_subprocess(default, {var: "false"}) is False
    assert resolve_export_in_subprocess(default, {var: "1"}) is True
    assert resolve_export_in_subprocess(default, {var: "none"}) is None
    asked = TraceConfig(backend=None, export_in_subprocess=True)
    assert resolve_export_in_subprocess(asked, {var: "0"}) is True
    with pytest.raises(ConfigError, match=var):
        resolve_export_in_subprocess(default, {var: "maybe"})

    monkeypatch.setenv(var, "false")
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, spool_dir=str(tmp_path / "spool"))
    try:
        with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
            pass
        assert tracer.flush(60)
        exporter = tracer.get_tracer().pipeline.workers[0].exporter
        assert type(exporter).__name__ == "MlflowExporter"  # not the child's proxy
    finally:
        tracer.reset()
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ConfigError, match=var):
        tracer.init(backend="mlflow", tracking_uri=mlflow_uri, spool_dir=str(tmp_path / "spool"))
    tracer.reset()
