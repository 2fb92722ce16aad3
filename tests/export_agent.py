"""A small tool-using agent traced the way users trace theirs, for the export/report tests.

Each trajectory: generate (asks for a tool) -> calculator tool (rollout 1 of sample 1 passes an
argument the tool rejects) -> generate (answer) -> reward. Rewards are chosen so some GRPO groups
have all-equal rewards (zero advantage). ``expected`` keeps what was traced, per
(step, sample_index, rollout_n), for row-by-row comparison.
"""

from __future__ import annotations

from typing import Any

import tracer

SAMPLES = 3
ROLLOUT_N = 2


class WordTokenizer:
    """Token id i decodes to the word ``w<i>``; enough for token2text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{i}" for i in ids)

    def __len__(self) -> int:
        return 100_000


def reward_of(step: int, sample: int, n: int) -> float:
    if sample == 0:
        return 1.0  # always solved: zero advantage
    if sample == 1:
        return 0.0  # never solved: zero advantage
    return float(n < step)


@tracer.trace_op(kind="generate")
def generate(prompt_ids: list[int], messages: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(prompt_ids)
    ids = [n + 1, n + 2, n + 3][: 2 + n % 2]
    return {"response_ids": ids, "finish_reason": "stop", "logprobs": [-0.5] * len(ids)}


@tracer.trace_op(kind="tool")
def calculator(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    expr = str(arguments["expression"])
    if not all(c in "0123456789+-* " for c in expr):
        raise ValueError(f"cannot evaluate {expr!r}")
    return {"name": name, "content": str(eval(expr)), "error": None}


@tracer.trace_op(kind="reward")
def score(step: int, sample: int, n: int) -> dict[str, Any]:
    return {"score": reward_of(step, sample, n)}


@tracer.trace_op(kind="trajectory")
def agent(step: int, sample: int, n: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
    prompt_ids = list(range(10 + sample))
    first = generate(prompt_ids, messages)
    expr = "x/y" if (sample, n) == (1, 1) else f"{sample}+7"
    error = None
    try:
        result = calculator("calculator", {"expression": expr})
        messages.append({"role": "tool", "content": result["content"]})
    except ValueError as exc:
        error = str(exc)
    second = generate(prompt_ids + first["response_ids"], messages)
    reward = score(step, sample, n)
    return {"first": first, "second": second, "expr": expr, "error": error, **reward}


def run(steps: list[int], validate: bool = False) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Trace SAMPLES x ROLLOUT_N trajectories per step; returns what each one did."""
    expected: dict[tuple[int, int, int], dict[str, Any]] = {}
    for step in steps:
        for sample in range(SAMPLES):
            for n in range(ROLLOUT_N):
                messages = [
                    {"role": "system", "content": "You can call the calculator."},
                    {"role": "user", "content": f"What is {sample} + 7?"},
                ]
                with tracer.trace_attr(
                    step=step, sample_index=sample, rollout_n=n, validate=validate
                ):
                    out = agent(step, sample, n, messages)
                expected[(step, sample, n)] = {**out, "prompt": messages[1]["content"]}
    return expected


def init(tmp: str, uri: str, project: str = "export-test", **options: Any) -> str:
    """tracer.init with MLflow and JSONL at once (and ``options``); returns the JSONL path."""
    path = f"{tmp}/traces.jsonl"
    tracer.init(
        {
            "backend": ["mlflow", "jsonl"],
            "tracking_uri": uri,
            "jsonl_path": path,
            "project_name": project,
            "experiment_name": "grpo",
            "token2text": True,
            "raise_internal_errors": True,
            **options,
        }
    )
    tracer.register_tokenizer(WordTokenizer())
    return path
