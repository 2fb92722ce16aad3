"""One configuration story (docs/configuration.md#where-options-come-from): ``tracer.init`` and
verl's ``RolloutTraceConfig.init`` (the switch's path) read the code, the file
``$ROLLOUT_TRACER_CONFIG`` and ``ROLLOUT_TRACER_<FIELD>`` variables in one order with one
validation; a misspelt variable fails init naming the closest one."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import tracer
from tests._markdown import ROOT
from tracer.config import ConfigError, TraceConfig
from tracer.config_sources import ENV_OTHERS, NOT_FROM_ENV, env_fields, options_from_env
from tracer.record import read_jsonl
from tracer.verl_compat import RolloutTraceConfig


@pytest.fixture(autouse=True)
def _fresh() -> object:
    tracer.reset()
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()
    tracer.reset()


def test_plain_init_reads_the_file_and_the_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Cluster users set variables, not code: the trajectory lands where the variable says."""
    path = tmp_path / "trace.yaml"
    path.write_text(f"jsonl_path: {tmp_path / 'from-file.jsonl'}\nmax_field_chars: 1000\n")
    monkeypatch.setenv("ROLLOUT_TRACER_CONFIG", str(path))
    monkeypatch.setenv("ROLLOUT_TRACER_JSONL_PATH", str(tmp_path / "from-env.jsonl"))
    monkeypatch.setenv("ROLLOUT_TRACER_SPOOL_DIR", str(tmp_path / "spool"))
    tracer.init(backend="jsonl")
    config = tracer.get_tracer().config
    assert config.spool_dir == str(tmp_path / "spool")
    assert config.max_field_chars == 1000  # the file's, no variable for it
    with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
        pass
    assert tracer.flush(30)
    assert [r.step for r in read_jsonl(str(tmp_path / "from-env.jsonl"))] == [1]
    assert not (tmp_path / "from-file.jsonl").exists()  # a variable wins over the file


def test_the_code_wins_and_fills_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ROLLOUT_TRACER_SPOOL_DIR", "/from/env")
    monkeypatch.setenv("ROLLOUT_TRACER_MAX_LIST_ITEMS", "7")
    said = {"backend": "memory", "spool_dir": str(tmp_path / "code")}
    for config, overrides in ((said, {}), ({"backend": "memory"}, said),
                              (TraceConfig(**said), {})):  # fmt: skip
        tracer.init(config, **overrides)
        got = tracer.get_tracer().config
        assert (got.spool_dir, got.max_list_items) == (str(tmp_path / "code"), 7)
    tracer.init(TraceConfig(backend="memory"))  # a TraceConfig left at the default: filled
    assert tracer.get_tracer().config.spool_dir == "/from/env"


def test_a_misspelt_variable_fails_every_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_TRACER_SPOL_DIR", "/x")
    closest = r"did you mean `ROLLOUT_TRACER_SPOOL_DIR`"
    with pytest.raises(ConfigError, match=closest):
        tracer.init(backend="memory")
    with pytest.raises(ConfigError, match=closest):  # verl's call, as the switch makes it
        RolloutTraceConfig.init("p", "e", "memory")
    monkeypatch.delenv("ROLLOUT_TRACER_SPOL_DIR")
    monkeypatch.setenv("ROLLOUT_TRACER_VRL", "1")  # the switch's own variable, misspelt
    with pytest.raises(ConfigError, match=r"did you mean `ROLLOUT_TRACER_VERL`"):
        tracer.init(backend="memory")
    monkeypatch.delenv("ROLLOUT_TRACER_VRL")
    monkeypatch.setenv("ROLLOUT_TRACER_BACKEND", "jsonl")  # verl's name: set in code
    with pytest.raises(ConfigError, match="ROLLOUT_TRACER_BACKEND is not read"):
        tracer.init(backend="memory")


def test_verl_style_init_reads_the_same_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_TRACER_MAX_FIELD_CHARS", "123")
    RolloutTraceConfig.init("proj", "exp", "memory")
    config = tracer.get_tracer().config
    assert (config.project_name, config.max_field_chars) == ("proj", 123)
    RolloutTraceConfig.reset()
    monkeypatch.setenv("ROLLOUT_TRACER_MAX_FIELD_CHARS", "-1")  # the same validation
    with pytest.raises(ConfigError, match="max_field_chars must be a positive integer"):
        RolloutTraceConfig.init("proj", "exp", "memory")


def _sample_text(name: str, annotation: str) -> str:
    kind = annotation.split("|")[0].strip()
    return {"bool": "1", "int": "1", "float": "1.5"}.get(kind) or (
        "{}" if kind.startswith("dict") else {"on_backend_error": "warn", "keep": "errors",
                                              "otlp_conventions": "genai"}.get(name, "a"))


def test_every_field_has_its_variable_with_no_list_to_update() -> None:
    """A field added to TraceConfig (say a stuck-trajectory limit) gets ROLLOUT_TRACER_<FIELD>
    from the dataclass itself: every field but verl's five and the callables is read."""
    names = {f.name for f in dataclasses.fields(TraceConfig)}
    assert set(env_fields()) == names - set(NOT_FROM_ENV)
    assert set(NOT_FROM_ENV) <= names  # the exclusions name real fields
    for name, f in env_fields().items():
        var = "ROLLOUT_TRACER_" + name.upper()
        assert name in options_from_env({var: _sample_text(name, str(f.type))}), var


# deliberate misspellings and refusals that the tests and docs show
# and variables of someone else that the tracer must only warn about
SHOWN_WRONG = {"SPOL_DIR", "VRL", "BACKEND", "REDACTT", "HOME", "LOG_LEVEL"}


def test_every_rollout_tracer_variable_the_project_names_is_known() -> None:
    """grep the project for ROLLOUT_TRACER_<NAME>: each is a field's variable, one of
    ENV_OTHERS (read by something else), or a mistake a test or page shows on purpose."""
    known = {n.upper() for n in env_fields()} | set(ENV_OTHERS) | SHOWN_WRONG
    found: dict[str, str] = {}
    for top in ("tracer", "rollout", "tests", "docs", "scripts", "benchmarks", "README.md",
                "setup.py"):  # fmt: skip
        paths = [ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*")
        for path in paths:
            if path.suffix not in (".py", ".md", ".pth", ".sh", ".yaml") or not path.is_file():
                continue
            for name in re.findall(r"ROLLOUT_TRACER_([A-Z][A-Z_]*[A-Z])", path.read_text()):
                found.setdefault(name, path.relative_to(ROOT).as_posix())
    unknown = {f"ROLLOUT_TRACER_{n}": where for n, where in found.items() if n not in known}
    assert unknown == {}, "add it to ENV_OTHERS in tracer/config_sources.py (who reads it)"
    assert {"VERL", "CONFIG", "CACHE", "SPOOL_DIR"} <= set(found)  # the scan must not go quiet


def test_the_configuration_page_tells_the_order_and_the_others() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("## Where options come from") :].split("\n## ")[0]
    for name in ENV_OTHERS:
        assert f"ROLLOUT_TRACER_{name}" in section, name
    assert "the code, then" in section.lower() or "lowest first" in section.lower()


def test_the_main_jobs_config_gets_the_variables_too(tmp_path: Path) -> None:
    """`rollout-tracer run`'s trace section (config/rollout.yaml) says `keep: []` and
    `tracking_uri: null`: the section's null and [] say nothing, so the variables fill them
    (rollout/cli.py merges before it picks the MLflow store); any other value wins."""
    from rollout.config import load_config, trace_config
    from tracer.config_sources import merged_options

    config = load_config([])
    section = config["actor_rollout_ref"]["rollout"]["trace"]
    assert section["keep"] == [] and section["tracking_uri"] is None
    env = {"ROLLOUT_TRACER_KEEP": "errors", "ROLLOUT_TRACER_TRACKING_URI": "sqlite:///x.db"}
    merged = merged_options(trace_config(config), env)
    assert (merged["keep"], merged["tracking_uri"]) == (["errors"], "sqlite:///x.db")
    section["keep"] = ["tool_errors"]
    assert merged_options(trace_config(config), env)["keep"] == ["tool_errors"]
    assert merged_options({"keep": []}, env)["keep"] == []  # a mapping's key is said
