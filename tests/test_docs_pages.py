"""Claims of docs/troubleshooting.md, docs/upgrading.md, docs/gpu.md, docs/verl.md and
docs/scale-out.md that a reader acts on, checked against the code (their Python blocks run in
tests/test_readme.py)."""

from __future__ import annotations

import ast
import os
import re

import pytest

import tracer
from tests._markdown import ROOT

DOCS = ROOT / "docs"


def _tracer_strings() -> str:
    """Every string the tracer's code holds (implicitly joined pieces joined, as Python does)."""
    found = []
    for path in (ROOT / "tracer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return "\n".join(found)


def test_every_log_line_troubleshooting_quotes_is_the_codes() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    table = text[text.index("| the line says |") :]
    quoted = re.findall(r"^\| `([^`]+)` \| `(tracer/[\w/]+\.py)` \|", table, re.M)
    assert len(quoted) >= 12  # the check must not go quiet
    strings = _tracer_strings()
    missing = [line for line, _ in quoted if line not in strings]
    assert missing == [], "docs/troubleshooting.md quotes lines the tracer no longer writes"
    gone = [path for _, path in quoted if not (ROOT / path).is_file()]
    assert gone == [], "docs/troubleshooting.md names files that are gone"


def test_upgrading_names_every_removed_key_and_the_versions() -> None:
    from tracer.config import REMOVED_KEYS
    from tracer.readers.schema import EXPORT_SCHEMA_VERSION

    text = (DOCS / "upgrading.md").read_text()
    for key in REMOVED_KEYS:
        assert f"| `{key}` |" in text, f"docs/upgrading.md does not list the removed key {key}"
    record = re.search(r"`tracer.SCHEMA_VERSION`, now \*\*(\d+)\*\*", text)
    export = re.search(r"`EXPORT_SCHEMA_VERSION` in `tracer/readers/schema.py`, now \*\*(\d+)\*\*",
                       text)  # fmt: skip
    assert record and int(record.group(1)) == tracer.SCHEMA_VERSION
    assert export and int(export.group(1)) == EXPORT_SCHEMA_VERSION


def test_the_gpu_page_says_it_was_not_run_on_a_gpu() -> None:
    assert "Nothing on this page\nwas run on a GPU here" in (DOCS / "gpu.md").read_text()


def test_verls_page_gives_each_entry_points_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    """Under the switch: verl's /tmp/mlruns.db; the drop-in API without it: ./mlflow.db."""
    from tracer.backends.mlflow_backend import resolve_tracking_uri
    from tracer.config import TraceConfig
    from tracer.verl_switch import switch_options

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "verl.md").read_text()
    under_switch = switch_options({})["tracking_uri"]
    assert under_switch == "sqlite:////tmp/mlruns.db" and f"`{under_switch}`" in text
    assert resolve_tracking_uri(TraceConfig(backend=None)) == f"sqlite:///{tmp_path}/mlflow.db"
    assert "without the switch\nwrites to `./mlflow.db`" in text


def test_scale_outs_done_line_is_what_the_default_config_runs() -> None:
    """docs/scale-out.md quotes the end of a run with the defaults: steps x prompts x n training
    trajectories; validation before training and at every test_freq-th and the last step."""
    from rollout.config import load_config
    from rollout.worker import validation_steps

    config = load_config([])
    trainer, data = config["trainer"], config["data"]
    rollout = config["actor_rollout_ref"]["rollout"]
    steps = int(trainer["total_steps"])
    train = steps * int(data["train_batch_size"]) * int(rollout["n"])
    before, after = validation_steps(config, steps)  # the run's own schedule
    passes = int(before) + len(after)
    val = passes * int(data["val_max_samples"]) * int(rollout["val_kwargs"]["n"])
    text = (DOCS / "scale-out.md").read_text()
    assert f"`done: {train} training + {val} validation trajectories in ... s on 2 workers`" \
        in text  # fmt: skip
