"""TRL's GRPOTrainer traced with one line (tracer.trl.trace), for real: TRL 1.16.0 on the CPU,
SmolLM2-135M-Instruct, one step on the project's math problems with a calculator tool, traced
into a real MLflow store and read back with MLflow's client, against TRL's own
``completions_*.parquet`` (``log_completions=True``).

One training run (one step of one GRPO group of 4: ~45 CPU-s, ~5 GB) shared by every
assertion of this module. What needs two steps (counters that add up over steps, each step's
live analysis, the weights a later step sampled with) is checked on the two steps of
tests/test_trl_reward_hack.py's run, with a tiny random model (#58: the second SmolLM2 step
was ~40 of the suite's CPU-seconds).

Tool calls: the 135M model never calls a tool by itself, so in this test the FIRST turn of two
completions per group is forced (TEST-ONLY, below: ``_force_first_turn``): their generated ids
are replaced by a calculator call, one with the problem's expression, one with a broken
expression (a failed call). TRL's own tool loop parses the call, runs the tool, appends its
result and lets the model generate the next turn, as for any model that calls tools.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("mlflow")
from tests.conftest import search_traces

# one xdist worker runs the whole module: the training (its module fixture) runs once,
# not once per worker (the suite's first run with this file trained three times: +15 min)
pytestmark = pytest.mark.xdist_group("trl")

NUM_GENERATIONS = 4
BATCH = 4  # completions a step: one prompt's GRPO group (a step with tools costs minutes here)
EXPERIMENT = "trl-grpo"
RUN = "run-1"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "12*13+5".
    """
    from rollout.tools import ToolError, safe_eval

    try:
        return str(safe_eval(expression))
    except ToolError:  # short: TRL drops a tool result that would overrun max_completion_length
        raise ValueError("invalid expression") from None


def accuracy_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    return [float(str(a) in _final_text(c)) for c, a in zip(completions, answer, strict=True)]


def length_reward(completions: list[Any], **_: Any) -> list[float | None]:
    return [-len(_final_text(c)) / 1000 for c in completions]


def _final_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "")


def _dataset() -> Any:
    from datasets import Dataset

    from rollout.worker import load_dataset

    rows = load_dataset()[:4]
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["question"]}], "answer": str(r["answer"]),
         "expression": r["solution"].split("=")[0].strip()}
        for r in rows
    ])  # fmt: skip


def _force_first_turn(trainer: Any, tokenizer: Any) -> None:
    """TEST-ONLY: the first turn of rollout_n 0 and 1 of each group becomes a calculator call
    (rollout_n 1's expression is broken: a failed call). Later turns are the model's own."""
    original_generate = trainer._generate
    original_turn = trainer._generate_single_turn
    batch: dict[str, Any] = {}

    def generate(prompts: list[Any]) -> Any:
        batch["prompts"], batch["first"] = prompts, True
        return original_generate(prompts)

    def single_turn(prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        ids, logprobs = original_turn(prompt_ids, *args, **kwargs)
        if batch.pop("first", False):
            for i, prompt in enumerate(batch["prompts"]):
                expression = _EXPRESSIONS[prompt[-1]["content"]]
                if i % NUM_GENERATIONS == 1:
                    expression += " +"
                if i % NUM_GENERATIONS in (0, 1):
                    call = json.dumps(
                        {"name": "calculator", "arguments": {"expression": expression}}
                    )
                    ids[i] = tokenizer.encode(f"<tool_call>\n{call}\n</tool_call><|im_end|>",
                                              add_special_tokens=False)  # fmt: skip
        return ids, logprobs

    trainer._generate = generate
    trainer._generate_single_turn = single_turn


_EXPRESSIONS: dict[str, str] = {}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import pandas as pd
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import tracer
    import tracer.trl
    from rollout.models import SMOLLM2, resolve_model_path

    tmp = tmp_path_factory.mktemp("trl")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    folder = resolve_model_path(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    # TRL's bundled Qwen 2.5 template renders tools and tool calls with SmolLM2's own
    # <|im_start|>/<|im_end|> tokens; SmolLM2's template prints only `content`
    template = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    data = _dataset()
    _EXPRESSIONS.update({r["prompt"][-1]["content"]: r["expression"] for r in data})
    args = GRPOConfig(
        output_dir=str(tmp / "out"), max_steps=1, per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS, max_completion_length=72, logging_steps=1,
        log_completions=True, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        learning_rate=1e-6, temperature=1.0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[accuracy_reward, length_reward],
                          args=args, train_dataset=data, processing_class=tokenizer,
                          tools=[calculator])  # fmt: skip
    _force_first_turn(trainer, tokenizer)
    # the one line
    tracer.trl.trace(trainer, backend="mlflow", tracking_uri=uri, project_name=EXPERIMENT,
                     experiment_name=RUN,
                     max_samples_per_step_per_worker=64, token2text=True,
                     raise_internal_errors=True)  # fmt: skip
    # one torch thread, given back after: the suite runs 3 workers on 2 cores, and torch's
    # default (a thread per core) made this training fight them (53 s alone, 378 s in the
    # suite, #58), as HFEngine's num_threads already avoids for generation
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    assert tracer.flush(60)
    tracer.shutdown()
    parquet = sorted((tmp / "out" / "completions").glob("completions_*.parquet"))
    return {"uri": uri, "tmp": tmp, "trainer": trainer, "tokenizer": tokenizer,
            "logged": pd.concat([pd.read_parquet(p) for p in parquet], ignore_index=True),
            "files": parquet}  # fmt: skip


@pytest.fixture(scope="module")
def traces(grpo_run: dict[str, Any]) -> dict[tuple[int, int, int], Any]:
    out = {}
    for t in search_traces(grpo_run["uri"], EXPERIMENT):
        tags = t.info.tags
        out[int(tags["step"]), int(tags["sample_index"]), int(tags["rollout_n"])] = t
    return out


def _spans(trace: Any, kind: str) -> list[Any]:
    return sorted(
        (s for s in trace.data.spans if s.span_type == kind), key=lambda s: s.start_time_ns
    )


def _close(a: Any, b: Any) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return b is not None and math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_every_logged_completion_is_a_trace_with_its_text_rewards_and_advantage(
    grpo_run: dict[str, Any], traces: dict[tuple[int, int, int], Any]
) -> None:
    logged = grpo_run["logged"]
    assert len(grpo_run["files"]) == 1 and len(logged) == BATCH
    assert len(traces) == len(logged)
    for row, step in zip(logged.itertuples(), logged["step"], strict=True):
        index = row.Index % BATCH
        trace = traces[int(step), index // NUM_GENERATIONS, index % NUM_GENERATIONS]
        completion = list(row.completion)
        said = [m["content"] for m in completion if m["role"] == "assistant"]
        turns = _spans(trace, "CHAT_MODEL")
        assert [s.outputs["content"] for s in turns] == said
        assert turns[0].inputs["messages"][-1]["content"] == list(row.prompt)[-1]["content"]
        reward = _spans(trace, "EVALUATOR")[-1].outputs
        for name in ("accuracy_reward", "length_reward"):
            assert _close(getattr(row, name), reward[name]), (name, row, reward)
        assert _close(row.accuracy_reward + row.length_reward, reward["score"])
        assert _close(row.advantage, float(trace.info.tags["advantage"]))
        assert _close(reward["score"], float(trace.info.tags["reward"]))
        assert trace.info.tags["policy_version"] == str(int(step) - 1)  # the weights that sampled
        group = f"{RUN}/step-{step}/sample-{index // NUM_GENERATIONS}"
        assert group in trace.info.trace_metadata.values()  # the MLflow session: its GRPO group
        assert {s.attributes["timing"] for s in turns} == {"trl_batch"}


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_tool_calls_are_spans_with_arguments_results_and_failures(
    grpo_run: dict[str, Any], traces: dict[tuple[int, int, int], Any]
) -> None:
    for (step, sample, n), trace in traces.items():
        tools = _spans(trace, "TOOL")
        if n not in (0, 1):
            continue  # the model's own turns: it may call a tool or not
        assert tools, (step, sample, n)
        call = tools[0]
        assert call.inputs["name"] == "calculator"
        assert set(call.inputs["arguments"]) == {"expression"}
        first = _spans(trace, "CHAT_MODEL")[0]
        # the first turn's token ids are TRL's (here the forced call), decoded by token2text
        assert "<tool_call>" in first.outputs["response_text"]
        assert first.attributes["response_tokens"] > 10
        assert first.outputs["finish_reason"] == "tool_calls"
        if n == 0:
            assert call.outputs == calculator(**call.inputs["arguments"])
        else:
            assert "invalid expression" in call.outputs["error"], call.outputs
    assert any(len(_spans(t, "CHAT_MODEL")) == 2 for t in traces.values())


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_tracer_counters_reach_trl_log(grpo_run: dict[str, Any]) -> None:
    history = [h for h in grpo_run["trainer"].state.log_history if "loss" in h]
    assert len(history) == 1
    assert [h["tracer/trl_completions"] for h in history] == [BATCH]
    assert history[-1]["tracer/submitted"] >= BATCH


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_the_live_analysis_reaches_trl_log(grpo_run: dict[str, Any]) -> None:
    """``tracer.step_metrics`` joins each training step's logs (what ``report_to`` trackers
    get): patterns/*, timing/* and the stuck count, the numbers the readers find afterwards in
    the MLflow store (read back through MLflow)."""
    from tracer.readers import read_tables
    from tracer.readers.habits.patterns import step_patterns

    history = [h for h in grpo_run["trainer"].state.log_history if "loss" in h]
    tables = read_tables("mlflow", experiment=EXPERIMENT, tracking_uri=grpo_run["uri"])
    found = step_patterns(tables.trajectories)
    assert [h["step"] for h in history] == found.steps == [1]
    for h in history:
        assert h["tracer/live_step_trajectories"] == BATCH
        assert h["tracer/stuck_trajectories"] == 0
        assert 0 < h["timing/generate_share"] <= 1 and "timing/wall_p50_s" in h
        for key, value in found.step_metrics(h["step"]).items():
            assert h[key] == pytest.approx(value), (h["step"], key)


def test_a_trainer_of_another_shape_is_refused_naming_the_tested_versions() -> None:
    import tracer.trl

    class NotGRPO:
        def log(self, logs: dict[str, float]) -> None: ...

    tested = r"tested with GRPOTrainer of TRL 1\.8 to 1\.16\.x"
    with pytest.raises(tracer.trl.TrlVersionError, match=tested):
        tracer.trl.trace(NotGRPO())


def test_import_tracer_stays_free_of_trl() -> None:
    import subprocess
    import sys

    code = "import sys, tracer; assert not {'trl', 'transformers', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def exported(grpo_run: dict[str, Any]) -> Path:
    from rollout.cli import main

    out = grpo_run["tmp"] / "export"
    assert main(["export", "--out", str(out), "--no-progress", *_store(grpo_run)]) == 0
    return out


def _store(grpo_run: dict[str, Any]) -> list[str]:
    return ["--from", "mlflow", "--tracking-uri", grpo_run["uri"], "--experiment", EXPERIMENT]


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_export_report_and_flags_read_the_trl_run(grpo_run: dict[str, Any], exported: Path) -> None:
    import pyarrow.parquet as pq

    from rollout.cli import main

    rows = pq.read_table(exported / "trajectories.parquet").to_pylist()
    logged = grpo_run["logged"]
    assert len(rows) == len(logged)
    by_key = {(r["step"], r["sample_index"], r["rollout_n"]): r for r in rows}
    for i, row in enumerate(logged.itertuples()):
        r = by_key[int(row.step), (i % BATCH) // NUM_GENERATIONS, i % NUM_GENERATIONS]
        assert _close(r["reward"], row.accuracy_reward + row.length_reward)
        # TRL's accuracy_reward is the run's correctness signal (possible reward hacking)
        assert _close(r["accuracy"], row.accuracy_reward)
        parts = dict(r["reward_parts"] or [])  # a Parquet map reads back as (key, value) pairs
        assert _close(parts.get("accuracy_reward"), row.accuracy_reward)
        if r["rollout_n"] in (0, 1):
            assert r["num_tool_calls"] == 1
        assert r["num_tool_errors"] == (1 if r["rollout_n"] == 1 else 0)
        assert r["prompt"] == list(row.prompt)[-1]["content"]
    tools = pq.read_table(exported / "tool_calls.parquet").to_pylist()
    assert {t["name"] for t in tools} == {"calculator"}
    assert all("expression" in json.loads(t["arguments"]) for t in tools)
    tokens = pq.read_table(exported / "tokens.parquet").to_pylist()
    # model tokens (loss_mask 1) and the tool results' tokens between turns (TRL's tool_mask 0)
    assert {t["loss_mask"] for t in tokens} == {0, 1}
    report = grpo_run["tmp"] / "report.html"
    assert main(["report", *_store(grpo_run), "--out", str(report)]) == 0
    html = report.read_text(encoding="utf-8")
    assert f"Rollout report: {EXPERIMENT} / {RUN}" in html
    assert sum(r["trace_id"] in html for r in rows) >= 1  # it links trajectories of the run
    assert main(["flags", *_store(grpo_run), "--no-progress"]) == 0


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.slow(seconds=240)
@pytest.mark.long
def test_the_explorer_shows_a_grpo_group_side_by_side(exported: Path, tmp_path: Path) -> None:
    import shutil

    if not shutil.which(CHROMIUM):
        pytest.skip("needs Debian's chromium")
    pytest.importorskip("duckdb")
    pq = pytest.importorskip("pyarrow.parquet")
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests._explore import serving

    rows = pq.read_table(exported / "trajectories.parquet").to_pylist()
    group = {r["rollout_n"]: r for r in rows if (r["step"], r["sample_index"]) == (1, 0)}
    with serving([("trl", exported)], tmp_path / "cache", search=0) as base, \
            sync_api.sync_playwright() as p:  # fmt: skip
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
        page = browser.new_page()
        page.goto(base + "#/group?step=1&sample=0&validate=false")
        page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
        cols = page.locator("#group .col")
        assert cols.count() == NUM_GENERATIONS == len(group)
        for i in range(cols.count()):
            col = cols.nth(i)
            r = group[int(col.get_attribute("data-rollout") or -1)]
            assert col.get_attribute("data-id") == r["trace_id"]
            assert ("tool errors" in col.inner_text()) == bool(r["num_tool_errors"])
        browser.close()
