"""What tracing costs a TRL GRPO training step (``tracer.trl.trace``): a side-by-side figure.

One real ``GRPOTrainer`` (TRL; SmolLM2-135M-Instruct, or a tiny random Qwen3, on the CPU; plain
GRPO; a tiny config) trains ``--steps`` steps; tracing is switched on for the even steps and off
for the odd ones (the wrappers installed and removed between steps), so both halves share the
model, the machine's load and its drift. Reported:

- the median step time traced and untraced, and their ratio (goal: under 1.02; sampling makes
  single steps vary by more than that, so read it with the noise it prints);
- the tracer's own time on the trainer's thread per traced step (copying the batch into
  trajectories and putting them in the buffer), as a share of the median step: the direct cost,
  which the step-time ratio can only bound.

    python -m benchmarks.trl_cost [--steps 12] [--out benchmarks/RESULTS-trl.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import quiet_env


def _reward(completions: list[Any], **_: Any) -> list[float | None]:
    return [float(len(str(c)) % 7) for c in completions]


def run(steps: int, completion_tokens: int, model_name: str) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import tracer
    import tracer.trl
    from rollout.models import resolve_model_path
    from rollout.worker import load_dataset

    tmp = Path(tempfile.mkdtemp(prefix="trl-cost-"))
    folder = resolve_model_path(model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rows = load_dataset()[: 2 * steps]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]}
                              for r in rows])  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp / "out"), max_steps=steps, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=completion_tokens,
                      logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                      learning_rate=1e-6)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[_reward], args=args, train_dataset=data,
                          processing_class=tokenizer)  # fmt: skip
    handle = tracer.trl.trace(trainer, backend="mlflow", project_name="trl-cost",
                              tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
                              max_samples_per_step_per_worker=64)  # fmt: skip
    record = handle._record
    spent: list[float] = []

    def timed_record(*a: Any) -> None:
        t0 = time.perf_counter()
        record(*a)
        spent.append(time.perf_counter() - t0)

    handle._record = timed_record  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"traced": [], "plain": []}

    class Toggle(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.traced = state.global_step % 2 == 0
            (handle.install if self.traced else handle.remove)()
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times["traced" if self.traced else "plain"].append(time.perf_counter() - self.t0)

    trainer.add_callback(Toggle())
    trainer.train()
    handle.install()  # flush through the wrappers' tracer; then stop
    stored = tracer.flush(120)
    tracer.shutdown()
    return {"times": times, "record_s": spent, "stored": stored,
            "traced": handle.traced}  # fmt: skip


def report(result: dict[str, Any], steps: int, tokens: int, model: str,
           load: tuple[float, ...]) -> str:  # fmt: skip
    traced, plain = result["times"]["traced"], result["times"]["plain"]
    med_t, med_p = statistics.median(traced), statistics.median(plain)
    spread = (max(plain) - min(plain)) / med_p if len(plain) > 1 else 0.0
    record_ms = statistics.median(result["record_s"]) * 1e3 if result["record_s"] else 0.0
    import trl

    lines = [
        "# TRL GRPO step: cost of tracer.trl.trace",
        "",
        f"Written by `python -m benchmarks.trl_cost --steps {steps} --tokens {tokens} --model "
        f"{model}` on {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; TRL "
        f"{trl.__version__}, {model} on the CPU, 8 completions a step (4 per prompt), "
        f"{tokens} new tokens, plain GRPO, mlflow backend (sqlite). Load average at start "
        f"{[round(x, 2) for x in load]} (a shared machine: compare the ratio, not the times).",
        "",
        "| | value |",
        "|---|---|",
        f"| median step, traced ({len(traced)} steps) | {med_t:.2f} s |",
        f"| median step, untraced ({len(plain)} steps) | {med_p:.2f} s |",
        f"| ratio traced / untraced (goal < 1.02) | {med_t / med_p:.3f} |",
        f"| spread of untraced steps (max - min) / median: the noise | {spread:.1%} |",
        f"| tracer's time on the trainer's thread per traced step | {record_ms:.2f} ms |",
        f"| the same, as a share of the median step | {record_ms / 1e3 / med_p:.4%} |",
        f"| completions traced; flush stored all | {result['traced']}; {result['stored']} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a builtin model (rollout/models.py): smollm2-135m-instruct, or "
        "tiny-qwen3 (2 random layers: the step is short, so the tracer's share "
        "is larger)",
    )
    parser.add_argument("--out", default="benchmarks/RESULTS-trl.md")
    ns = parser.parse_args(argv)
    quiet_env()
    load = os.getloadavg()
    text = report(run(ns.steps, ns.tokens, ns.model), ns.steps, ns.tokens, ns.model, load)
    Path(ns.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
