"""A multi-turn tool-using rollout traced the way the agent loop (rollout/agent_loop.py) traces
its own: generate (the engine call, with the conversation so far) -> parse (the reply's tool
calls) -> the tool -> ... -> a final answer -> reward. Used by the OpenInference, Phoenix and
Inspect export tests; ``EXPECTED`` keeps what each trajectory did, for comparison."""

from __future__ import annotations

import json
import math
from typing import Any

import tracer

QUESTION = "What is (17 * 23) + 4? Use the calculator."
SYSTEM = "You are a careful assistant. Call the calculator for arithmetic."
# the calculator's parameters, as the rollout's tools give them (rollout/tools.py)
CALCULATOR_SCHEMA = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "arithmetic only"}},
    "required": ["expression"],
}


def script(sample: int) -> list[dict[str, Any]]:
    """The replies of one trajectory: two tool calls, then the answer."""
    first = {"expression": f"17 * {23 + sample}"}
    second = {"expression": f"{17 * (23 + sample)} + 4"}
    answer = 17 * (23 + sample) + 4
    return [
        {"content": "Let me multiply first.", "tool_calls": [("calculator", first)]},
        {"content": "Now add four.", "tool_calls": [("calculator", second)]},
        {"content": f"The answer is {answer}.", "tool_calls": []},
    ]


@tracer.trace_op(kind="generate")
def generate(prompt_ids: list[int], messages: list[dict[str, Any]], turn: int, sample: int) -> Any:
    reply = script(sample)[turn]
    text = reply["content"] + "".join(
        f"\n<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>"
        for n, a in reply["tool_calls"]
    )
    ids = [100 + turn * 10 + i for i in range(5)]
    logprobs = [-0.25 * (i + 1) for i in range(5)]
    return {"content": text, "response_ids": ids, "finish_reason": "stop", "logprobs": logprobs}


@tracer.trace_op(kind="parse")
def parse(text: str) -> dict[str, Any]:
    head, *calls = text.split("\n<tool_call>")
    parsed = [json.loads(c.removesuffix("</tool_call>")) for c in calls]
    return {"content": head, "tool_calls": parsed}


def calculator(expression: str) -> str:
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


@tracer.trace_op(kind="tool", name="call_tool")
def call_tool(name: str, arguments: dict[str, Any]) -> str:
    """One op for every tool, as rollout/tools.py's ``ToolRegistry.call``: the span's name is
    the op's (``call_tool``), the tool's name is in its inputs, its schema set on the span."""
    tracer.set_span_attributes(tool_schema=CALCULATOR_SCHEMA)
    return {"calculator": calculator}[name](**arguments)


@tracer.trace_op(kind="reward")
def score(answer: str, target: int) -> float:
    return 1.0 if answer.endswith(f"{target}.") else 0.0


EXPECTED: dict[tuple[int, int, int], dict[str, Any]] = {}


@tracer.trace_op(kind="trajectory")
def agent(sample: int, messages: list[dict[str, Any]], max_turns: int = 3,
          fail: bool = False) -> dict[str, Any]:  # fmt: skip
    """``max_turns`` below 3 ends the trajectory on a tool result (the turn limit came before
    the answer, so no reward); ``fail`` raises after the first tool result."""
    prompt_ids = list(range(1, 21))
    turn = 0
    while True:
        out = generate(prompt_ids, messages, turn, sample)
        parsed = parse(out["content"])
        message: dict[str, Any] = {"role": "assistant", "content": parsed["content"]}
        calls = parsed["tool_calls"]
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{turn}_{k}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for k, c in enumerate(calls)
            ]  # fmt: skip
        messages.append(message)
        if not calls:
            break
        for k, call in enumerate(calls):
            result = call_tool(call["name"], call["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{turn}_{k}", "name": call["name"],
                 "content": result}
            )  # fmt: skip
        if fail:
            raise ConnectionError("engine lost")
        prompt_ids = prompt_ids + out["response_ids"] + [7, 8]
        turn += 1
        if turn == max_turns:
            return {"messages": messages, "reward": None}
    target = 17 * (23 + sample) + 4
    reward = score(messages[-1]["content"], target)
    return {"messages": messages, "reward": reward}


def run(step: int, samples: int = 2, rollout_n: int = 2, **options: Any) -> None:
    """Trace ``samples`` x ``rollout_n`` trajectories of ``step``; fills ``EXPECTED``.
    ``options``: :func:`agent`'s ``max_turns`` and ``fail`` (its error is caught here)."""
    for sample in range(samples):
        for n in range(rollout_n):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION},
            ]
            try:
                with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
                    out = agent(sample, messages, **options)
            except ConnectionError:
                if not options.get("fail"):
                    raise
                out = {"messages": messages, "reward": None}
            turns = sum(m["role"] == "assistant" for m in out["messages"])
            EXPECTED[(step, sample, n)] = {
                "messages": out["messages"],
                # the score op's value: the last numeric reward recorded
                "reward": None if out["reward"] is None else 1.0,
                "logprobs": [-0.25 * (i + 1) for i in range(5)] * turns,
            }


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
