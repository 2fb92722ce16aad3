"""The main job as the README's first screen writes it (`rollout-tracer run`, the default
config, in an empty folder), then the UI command the first screen names on what it wrote.

It shows what the tracer is for: real tool calls from SmolLM2 by structured decoding (real
xgrammar), answers that end by themselves, validation passes on the same prompts, a tracker
table of validation generations, the token view; read back with MLflow's own client and
through `rollout-tracer ui`'s server. One run serves both (it is the suite's costliest test):
the newcomer's path of tests/test_newcomer.py and the main job's content."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests._markdown import ROOT, first_screen_commands
from tests.conftest import search_traces
from tests.token_view_checks import check_token_view
from tracer.readers.sources import iter_mlflow


def _spans(trace: Any, name: str | None = None, span_type: str | None = None) -> list[Any]:
    spans = sorted(trace.data.spans, key=lambda s: s.start_time_ns)
    return [s for s in spans if (name is None or s.name == name)
            and (span_type is None or s.span_type == span_type)]  # fmt: skip

# ~120 s alone on 2 quiet cores (206-251 s in a full run, 314 s with a busy loop on one core;
# 2026-12-04), by nature: the default config as users
# run it, SmolLM2 generating on CPU (8 training and 4 validation trajectories, structured
# decoding), the trainer pass; `seconds` puts it first in the suite's order (conftest.py)
@pytest.mark.slow(seconds=250)
@pytest.mark.long
@pytest.mark.export_child  # the main job as users run it: the default export child
def test_default_run_in_mlflow(tmp_path: Path) -> None:
    pytest.importorskip("xgrammar")
    [main_job] = [s for s in first_screen_commands() if s[-1] == ["rollout-tracer", "run"]]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_TRACKING", "ROLLOUT_"))}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cli = [sys.executable, "-m", "rollout.cli"]  # the console script's entry, from this checkout
    # the first screen's command, plus the MLflow tracker (the validation table and the token
    # view's step metrics are checked below; the traces' path is the same without it). The
    # bound is for a hang: 78 s on 2 quiet cores, 24 min at a load average of 8
    run = subprocess.run([*cli, *main_job[-1][1:], "trainer.logger=[console,mlflow]"],
                         cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=3600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^done: 8 training \+ 4 validation trajectories", run.stdout, re.M)
    assert "rollout-tracer ui" in run.stdout  # it says how to browse
    assert (tmp_path / "mlflow.db").exists()
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train = search_traces(mlflow_uri, "rollout-tracer", "tags.validate = 'false'")
    assert len(train) == 8  # 2 steps x 1 prompt x 4 samples
    results = 0
    for trace in train:
        gens = _spans(trace, "generate")
        first = gens[0]
        # tool_choice=required on the first turn: a Hermes tool call, parsed and run
        assert first.outputs["response_text"].startswith('<tool_call>\n{"name": "calculator"')
        [tool] = [s for s in _spans(trace, span_type="TOOL") if s.start_time_ns > first.end_time_ns
                  and s.start_time_ns < gens[1].start_time_ns]  # fmt: skip
        assert tool.inputs["name"] == "calculator" and tool.outputs["content"]
        results += tool.outputs["error"] is None
        assert f"<tool_response>\n{tool.outputs['content']}" in gens[1].inputs["prompt_text"]
        # compact token ids in the UI (the export gets them whole, below)
        shown = first.inputs["prompt_ids"]
        assert isinstance(shown, str) and re.fullmatch(r"\d+ items: \[[\d, ]+…[\d, ]+\]", shown)
        for span in trace.data.spans:
            assert "token2text_error" not in (span.attributes or {}), span.name
    assert results >= 4, "most calculator calls should return a value"
    later = [g.outputs["finish_reason"] for t in train for g in _spans(t, "generate")[1:]]
    assert later.count("stop") >= len(later) // 3, later  # answers end by themselves
    finish = [_spans(t, "run")[0].outputs["finish_reason"] for t in train]
    assert finish.count("stop") >= 2, finish  # whole trajectories, not cut by a limit
    rewards: dict[tuple[str, str], set[Any]] = {}
    for t in train:
        key = (t.info.tags["step"], t.info.tags["sample_index"])
        rewards.setdefault(key, set()).add(t.info.tags.get("reward"))
    assert any(len(r) > 1 for r in rewards.values()), rewards  # rewards vary within a group

    val = search_traces(mlflow_uri, "rollout-tracer", "tags.validate = 'true'")
    by_step: dict[str, dict[str, str]] = {}
    for t in val:
        prompt = _spans(t, "generate")[0].inputs["prompt_text"]
        by_step.setdefault(t.info.tags["step"], {})[t.info.tags["sample_index"]] = prompt
    assert set(by_step) == {"0", "2"}  # val_before_train, then test_freq=2 (the last step)
    assert by_step["0"] == by_step["2"] and len(by_step["0"]) == 2

    # the export reads whole token-id lists back
    records = [r for page in iter_mlflow(mlflow_uri, "rollout-tracer") for r in page]
    gen = next(s for r in records for s in r.spans if s.name == "generate")
    assert isinstance(gen.inputs["prompt_ids"], list) and len(gen.inputs["prompt_ids"]) > 100
    assert gen.attributes["prompt_tokens"] == len(gen.inputs["prompt_ids"])

    # trainer.log_val_generations: 2 -> a table per validation pass in the MLflow run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("rollout-tracer")
    [run] = client.search_runs([exp.experiment_id])
    names = {a.path for a in client.list_artifacts(run.info.run_id, "val_generations")}
    assert names == {"val_generations/step_000000.json", "val_generations/step_000002.json"}
    local = client.download_artifacts(run.info.run_id, "val_generations/step_000002.json",
                                      str(tmp_path))  # fmt: skip
    table = json.loads(Path(local).read_text())
    assert len(table["data"]) == 2 and "response" in table["columns"]
    history = client.get_metric_history(run.info.run_id, "val/reward/mean")
    assert sorted(m.step for m in history) == [0, 2]
    # where each step's time went (the tracer's live analysis): the calculator's real latency
    for name in ("timing/tool_share/calculator", "timing/generate_share", "timing/wall_p50_s"):
        values = [m.value for m in client.get_metric_history(run.info.run_id, name)]
        assert len(values) == 2 and all(v > 0 for v in values), (name, values)

    # the token view: trainer and reference log-probs on every model token, rollout_corr/*
    check_token_view(tmp_path, mlflow_uri, client, run.info.run_id)

    # the first screen's UI command, in the same folder, serves this run's traces
    _ui_serves_the_run(tmp_path, env, cli)


def _ui_serves_the_run(folder: Path, env: dict[str, str], cli: list[str]) -> None:
    [[ui]] = [s for s in first_screen_commands() if s[0][:2] == ["rollout-tracer", "ui"]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*cli, *ui[1:], "--port", str(port)], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        url, said = None, []
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # ends when the command exits
            said.append(line)
            if line.startswith("MLflow trace UI: "):
                url = line.split(": ", 1)[1].strip()
                break
            assert time.monotonic() < deadline, "".join(said)
        assert url and url.startswith(f"http://127.0.0.1:{port}/#/experiments/"), "".join(said)
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read(4096).lower()
        exp_id = url.split("/experiments/")[1].split("/")[0]
        body = json.dumps({"locations": [{"type": "MLFLOW_EXPERIMENT",
                                          "mlflow_experiment": {"experiment_id": exp_id}}],
                           "max_results": 50}).encode()  # fmt: skip
        search = urllib.request.Request(
            f"http://127.0.0.1:{port}/ajax-api/3.0/mlflow/traces/search", data=body,
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(search, timeout=60) as resp:
            assert len(json.loads(resp.read())["traces"]) == 12  # 8 training + 4 validation
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the ui stops its server's group on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
