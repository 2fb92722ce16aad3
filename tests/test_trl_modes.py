"""TRL the ways its users run it, traced (issue #60, and #55's TRL details), with real TRL
1.16 on the CPU and the tiny random Qwen3 (tiny-qwen3), one optimizer step each:

- ``examples/trl_grpo.py`` end to end, as its docstring says, under ``accelerate launch
  --multi_gpu --num_processes 2`` (two CPU processes, gloo), an evaluation included;
- ``tests/_trl_modes.py`` in one process: an ``environment_factory`` with a tool and a reward,
  reward functions named ``score`` and ``fmt``, an evaluation of two batches, Qwen3 thinking;
  then a ``rollout_func`` with environment tokens.

Both run once, side by side, as subprocesses (each trains in its own process, one thread); every
assertion reads what they left: the JSONL traces (through the project's readers and its
``rollout-tracer`` commands) and TRL's own ``trainer_state.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from tests._servers import free_port
from tests._trl_modes import (
    ROLLOUT_ENV,
    ROLLOUT_FIRST,
    ROLLOUT_LAST,
    THOUGHT,
)

pytestmark = pytest.mark.xdist_group("trl-modes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_grpo.py"
PER_PROCESS, GENERATIONS = 3, 2  # 6 completions a step: group 1 lies on both processes


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rollout.models import TINY_QWEN3, resolve_model_path

    tmp = tmp_path_factory.mktemp("trl-modes")
    model = str(resolve_model_path(TINY_QWEN3))  # built before the two children race for it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1"}  # fmt: skip
    example = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(EXAMPLE), "--cpu", "--model", model,
        "--chat-template", "qwen3", "--output-dir", str(tmp / "example"), "--max-steps", "1",
        "--batch-size", str(PER_PROCESS), "--num-generations", str(GENERATIONS),
        "--max-completion-length", "12", "--backend", "jsonl",
        "--jsonl-path", str(tmp / "example.jsonl"),
    ]  # fmt: skip
    modes = [sys.executable, "-m", "tests._trl_modes", str(tmp)]
    procs = {name: subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
             for name, cmd in (("example", example), ("modes", modes))}  # fmt: skip
    for name, proc in procs.items():
        try:  # a process left waiting in a collective would show as a timeout here
            out, _ = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"{name} did not exit: {out.decode(errors='replace')[-3000:]}")
        assert proc.returncode == 0, f"{name}: {out.decode(errors='replace')[-3000:]}"
    return {"tmp": tmp, "example": tmp / "example.jsonl", "env": tmp / "env.jsonl",
            "rollout": tmp / "rollout.jsonl", "result": tmp / "result.json"}  # fmt: skip


def _records(path: Path) -> list[Any]:
    from tracer.readers import iter_records

    return [r for page in iter_records("jsonl", path=str(path)) for r in page]


def _spans(record: Any, kind: str) -> list[Any]:
    return sorted((s for s in record.spans if s.kind == kind), key=lambda s: s.start_ns)


def _export(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Any, str]:
    """``rollout-tracer export`` of a JSONL file, without ``--tokenizer``: (tables, stderr)."""
    import pyarrow.parquet as pq

    from rollout.cli import main

    capsys.readouterr()
    assert main(["export", "--from", "jsonl", "--path", str(path), "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    return {t: pq.read_table(out / f"{t}.parquet").to_pylist()
            for t in ("trajectories", "turns", "tokens")}, err  # fmt: skip


@pytest.mark.slow(seconds=120)
@pytest.mark.long
def test_two_processes_trace_every_completion_once_with_whole_groups(
    runs: dict[str, Path],
) -> None:
    records = _records(runs["example"])
    train = [r for r in records if not r.validate]
    keys = [(r.step, r.sample_index, r.rollout_n) for r in train]
    assert len(train) == 2 * PER_PROCESS and len(set(keys)) == len(keys)  # each once
    assert len({r.worker_id for r in train}) == 2  # both processes traced theirs
    groups: dict[Any, list[Any]] = defaultdict(list)
    for r in train:
        groups[r.sample_index].append(r)
    assert sorted(groups) == [0, 1, 2]
    for group in groups.values():  # whole: every rollout_n once, one prompt
        assert sorted(r.rollout_n for r in group) == list(range(GENERATIONS))
        assert len({json.dumps(_spans(r, "generate")[0].inputs["messages"]) for r in group}) == 1
    # the group TRL splits across the processes is one group, not two halves
    assert any(len({r.worker_id for r in g}) == 2 for g in groups.values())
    questions = {q for q, _ in _example().PROBLEMS[:8]}
    assert all(_spans(r, "generate")[0].inputs["messages"][-1]["content"] in questions
               for r in train)  # fmt: skip


@pytest.mark.slow(seconds=120)
@pytest.mark.long
def test_two_processes_log_the_merged_step_metrics_once(runs: dict[str, Path]) -> None:
    """The main process logs the step's numbers of both processes (TRL's trainer_state.json,
    what report_to trackers get), once a step; the evaluation's apart, as eval_*."""
    state = json.loads((runs["tmp"] / "example" / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    evals = [h for h in state["log_history"] if "eval_loss" in h]
    assert len(steps) == 1 and len(evals) == 1
    (h,), (e,) = steps, evals
    assert h["tracer/trl_processes"] == 2 and h["tracer/trl_completions"] == 2 * PER_PROCESS
    assert h["tracer/live_step_trajectories"] == 2 * PER_PROCESS
    assert h["tracer/submitted"] == 2 * PER_PROCESS  # both processes' counters, added up
    assert 0 < h["timing/generate_share"] <= 1
    assert e["eval_tracer/live_step_trajectories"] == 4  # 2 held-out problems x 2
    assert not any(k.startswith("eval_") for k in h)


@pytest.mark.slow(seconds=120)
@pytest.mark.long
def test_two_processes_trace_the_evaluation_as_validate(runs: dict[str, Path]) -> None:
    records = _records(runs["example"])
    held_out = {q for q, _ in _example().PROBLEMS[8:]}
    val = [r for r in records if r.validate]
    assert len(val) == 4 and {r.step for r in val} == {1}
    assert sorted((r.sample_index, r.rollout_n) for r in val) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {_spans(r, "generate")[0].inputs["messages"][-1]["content"] for r in val} == held_out


@pytest.mark.slow(seconds=60)
@pytest.mark.long
def test_evaluation_batches_are_validate_and_apart_in_export_report_and_flags(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout.cli import main

    tables, _ = _export(runs["env"], runs["tmp"] / "env-export", capsys)
    rows = tables["trajectories"]
    val = sorted((r["step"], r["sample_index"], r["rollout_n"]) for r in rows if r["validate"])
    # two eval batches (4 rows, more than a training batch, then 2): numbered on, not again
    assert val == [(1, s, n) for s in range(3) for n in range(2)]
    assert sum(not r["validate"] for r in rows) == 2
    store = ["--from", "jsonl", "--path", str(runs["env"])]
    assert main(["report", *store, "--out", str(runs["tmp"] / "report.html")]) == 0
    assert "report of 2 training and 6 validation trajectories" in capsys.readouterr().out
    assert main(["flags", *store, "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)
    validate = {r["trace_id"]: r["validate"] for r in rows}
    for entry in flags["steps"]:  # a step's flag counts training or validation, never both
        assert {validate[t] for t in entry["trace_ids"]} <= {entry["validate"]}


@pytest.mark.slow(seconds=60)
@pytest.mark.long
def test_an_environment_factorys_tool_calls_and_reward_are_traced(runs: dict[str, Path]) -> None:
    records = _records(runs["env"])
    assert len(records) == 8
    for r in records:
        first = _spans(r, "generate")[0]
        # reset()'s observation is part of the prompt TRL generated from
        assert first.inputs["messages"][-1]["content"].endswith(" The counter is at 2.")
        reward = _spans(r, "reward")[-1].outputs
        if r.rollout_n == 0:  # forced: the environment's tool was called, 2 + 3 = 5
            (tool,) = _spans(r, "tool")
            assert tool.name == "add" and tool.inputs["arguments"] == {"amount": 3}
            assert tool.outputs == "5"
            assert reward["Counter"] == 1.0  # the environment's get_reward, a reward part
        # a reward function named score keeps its value; the weighted sum goes under reward
        assert reward["score"] == pytest.approx(0.5 + 0.1 * r.rollout_n)
        assert reward["fmt"] == (None if r.rollout_n else 1.0)
        total = 2.0 * reward["score"] + (reward["fmt"] or 0.0) + reward["Counter"]
        assert reward["reward"] == pytest.approx(total) == pytest.approx(r.reward)


@pytest.mark.slow(seconds=60)
@pytest.mark.long
def test_thinking_is_its_own_field_and_the_export_decodes_tokens_without_flags(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("duckdb")
    from tracer.readers.explore.store import Run, Store

    out = runs["tmp"] / "env-export-2"
    tables, err = _export(runs["env"], out, capsys)
    forced = {r["trace_id"] for r in tables["trajectories"] if r["rollout_n"] == 0}
    first_turns = [t for t in tables["turns"] if t["trace_id"] in forced and t["turn_index"] == 0]
    assert len(first_turns) == 4
    for turn in first_turns:
        assert turn["reasoning"] == THOUGHT and "<think>" not in (turn["response_text"] or "")
    # the traces name their tokenizer (tiny-qwen3's folder): the token text, without --tokenizer
    assert tables["tokens"] and all(t["token"] is not None for t in tables["tokens"])
    assert "token ids without their text" not in err
    store = Store([Run("env", str(out), {"trajectories", "turns", "tool_calls", "tokens"})])
    shown = store.trajectory(None, first_turns[0]["trace_id"])  # the explorer's transcript
    assert shown["turns"][0]["reasoning"] == THOUGHT
    html = (ROOT / "tracer/readers/explore/static/explore.html").read_text(encoding="utf-8")
    assert "turn.reasoning ?" in html


def _hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """A Hugging Face hub cache holding ``repo``'s tokenizer files (from ``folder``), laid out
    as huggingface_hub lays out what it downloads."""
    base = root / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0" * 40)
    for f in folder.iterdir():
        if f.suffix in (".json", ".jinja"):
            (snapshot / f.name).write_bytes(f.read_bytes())
    return root


@pytest.mark.long
def test_the_export_loads_a_named_tokenizer_from_the_local_cache_or_says_why_not(
    runs: dict[str, Path],
) -> None:
    """Traces recorded elsewhere name a model id (cached here: decoded), another machine's
    folder and an id not cached here (both named in the note, with why)."""
    import pyarrow.parquet as pq

    lines = runs["rollout"].read_text(encoding="utf-8").splitlines()
    folder = json.loads(lines[0])["spans"][1]["attributes"]["tokenizer"]
    cache = _hub_cache(runs["tmp"] / "hub", "tiny-org/tiny-qwen3", Path(folder))
    names = ["tiny-org/tiny-qwen3", str(ROOT.parent / "no-such-model"), "no-such-org/no-model"]
    moved = runs["tmp"] / "elsewhere.jsonl"
    with moved.open("w", encoding="utf-8") as f:
        for k, name in enumerate(names):  # three trajectories, renamed (new trace ids)
            line = lines[k % 2].replace(json.dumps(folder), json.dumps(name))
            record = json.loads(line)
            record["trace_id"] = f"{k + 1:032x}"
            f.write(json.dumps(record) + "\n")
    out = runs["tmp"] / "elsewhere"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "export", "--from", "jsonl",
                           "--path", str(moved), "--out", str(out), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = pq.read_table(out / "tokens.parquet").to_pylist()
    text = {t["trace_id"]: t["token"] is not None for t in tokens}
    assert text == {f"{1:032x}": True, f"{2:032x}": False, f"{3:032x}": False}
    assert "token ids without their text" in done.stderr and "--tokenizer" in done.stderr
    assert f"{names[1]}: neither a local folder" in done.stderr
    hub = "neither a local folder, a model in the cache, nor a Hugging Face model id in this"
    assert f"{names[2]}: {hub} machine's Hugging Face cache" in done.stderr


@pytest.mark.slow(seconds=60)
@pytest.mark.long
def test_a_rollout_funcs_model_and_environment_tokens_are_traced(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    from rollout.models import TINY_QWEN3, resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(TINY_QWEN3)))
    first, env, last = (tok.encode(t, add_special_tokens=False)
                        for t in (ROLLOUT_FIRST, ROLLOUT_ENV, ROLLOUT_LAST))  # fmt: skip
    records = _records(runs["rollout"])
    assert sorted((r.sample_index, r.rollout_n) for r in records) == [(0, 0), (0, 1)]
    for r in records:
        turns = _spans(r, "generate")  # the model's two segments, cut by env_mask
        assert [t.outputs["response_ids"] for t in turns] == [first, last]
        assert ROLLOUT_FIRST in turns[0].outputs["content"]  # TRL's decoded message, once
        assert turns[1].inputs["prompt_ids"][-len(first + env):] == first + env
    tables, _ = _export(runs["rollout"], runs["tmp"] / "rollout-export", capsys)
    masks = Counter(t["loss_mask"] for t in tables["tokens"])
    assert masks == {1: 2 * len(first + last), 0: 2 * len(env)}  # the environment's: 0
    # the rollout_func's log-probs, on the model's tokens
    assert {t["rollout_logprob"] for t in tables["tokens"] if t["loss_mask"]} == {-0.25}
