"""One TRL completion -> the spans of its trajectory (for :mod:`tracer.trl`).

Plain data in, :class:`~tracer.trajectory.Span` out: no TRL, no torch (the tensors are turned
into lists by :func:`rows` first). ``docs/trl.md`` gives the mapping.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from tracer.trajectory import Span

# where the weighted sum goes on the reward span: `score` (verl's name), unless a reward
# function of the user's already has that name (its value is kept under it)
_TOTAL_KEYS = ("score", "reward", "weighted_reward")


def num(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def rows(tensor: Any, mask: Any) -> list[list[Any]]:
    """Each row of a padded (batch x length) tensor, cut to its mask."""
    values, keep = tensor.tolist(), mask.tolist()
    return [
        [v for v, m in zip(row, k, strict=False) if m] for row, k in zip(values, keep, strict=True)
    ]


def token_turns(output: dict[str, Any]) -> list[list[tuple[list[int], list[int]]]] | None:
    """Per completion: its model turns' token ids, each with the tool-result ids that follow
    it (TRL's ``tool_mask`` 0, or a ``rollout_func``'s ``env_mask`` 0), as (model_ids,
    tool_ids) pairs."""
    ids = output.get("completion_ids")
    if ids is None:
        return None
    mask = output["completion_mask"]
    out_rows = rows(ids, mask)
    tool = output.get("tool_mask")
    tools = rows(tool, mask) if tool is not None else [[1] * len(r) for r in out_rows]
    out = []
    for row, marks in zip(out_rows, tools, strict=True):
        turns: list[tuple[list[int], list[int]]] = []
        for token, mark in zip(row, marks, strict=False):
            if not turns or (mark and turns[-1][1]):  # a model token after tool tokens
                turns.append(([], []))
            turns[-1][1 if not mark else 0].append(token)
        out.append(turns)
    return out


def tokenizer_name(processing_class: Any) -> str | None:
    """The name an export loads the tokenizer by (``name_or_path``: a model id or a folder);
    a processor's inner tokenizer's."""
    for obj in (processing_class, getattr(processing_class, "tokenizer", None)):
        name = getattr(obj, "name_or_path", None)
        if isinstance(name, str) and name:
            return name
    return None


def spans(root: int, prompt: Any, completion: Any, turns: list[tuple[list[int], list[int]]] | None,
          prompt_ids: list[int] | None, logprobs: list[float] | None, eos: set[int], t0: int,
          t1: int) -> list[Span]:  # fmt: skip
    """One generate span per assistant message (its prompt ids: the prompt and every token
    before the turn, tool results included) and one tool span per tool call. TRL does not
    time single turns: each span carries the generation batch's window (start ``t0`` plus its
    order in nanoseconds, end ``t1``) and ``timing="trl_batch"``."""
    messages = completion if isinstance(completion, list) else [
        {"role": "assistant", "content": completion}]  # fmt: skip
    history = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    segments = False
    if turns is not None and len(turns) != len(assistant):
        # a rollout_func's env_mask: TRL decodes the whole completion as one message, the mask
        # cuts it in model segments (one turn each, the message's text on the first)
        segments = len(assistant) == 1 and len(turns) > 1
        if not segments:
            turns = None  # TRL rolled a turn back (too long): keep the text, not misplaced ids
    if segments and turns is not None:
        assistant = assistant * len(turns)
    out_spans: list[Span] = []
    offset = 0
    context = list(prompt_ids or [])
    for k, i in enumerate(assistant):
        msg = messages[i] if k == 0 or not segments else {"role": "assistant"}
        calls = msg.get("tool_calls") or []
        out: dict[str, Any] = {"content": _text(msg.get("content")), "tool_calls": calls or None}
        if msg.get("reasoning_content"):  # Qwen3-style thinking, parsed apart by TRL
            out["reasoning_content"] = _text(msg["reasoning_content"])
        inputs: dict[str, Any] = {"messages": history + messages[:i]}
        if turns is not None:
            model_ids = turns[k][0]
            if prompt_ids is not None:
                inputs["prompt_ids"] = list(context)
                context += model_ids + turns[k][1]
            out["response_ids"] = list(model_ids)
            if logprobs is not None:
                out["logprobs"] = logprobs[offset : offset + len(model_ids)]
            offset += len(model_ids) + len(turns[k][1])
            last = model_ids[-1] if model_ids else None
            # a segment the environment answered (env_mask 0 after it) stopped there
            out["finish_reason"] = ("tool_calls" if calls else "stop" if last in eos or (
                segments and turns[k][1]) else "length")  # fmt: skip
        gen = Span("generate", "generate", root, inputs, t0 + len(out_spans) + 1)
        gen.outputs, gen.end_ns = out, t1
        gen.set_attr("timing", "trl_batch")
        out_spans.append(gen)
        results = [m for m in messages[i + 1 :]]
        results = results[: next((n for n, m in enumerate(results) if m.get("role") != "tool"),
                                 len(results))]  # fmt: skip
        for c, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, dict) else {}
            name = str(function.get("name", "unknown"))
            result = results[c].get("content") if c < len(results) else None
            tool = Span(name, "tool", root, {"name": name, "arguments": function.get("arguments")},
                        t0 + len(out_spans) + 1)  # fmt: skip
            tool.outputs, tool.end_ns = _tool_result(result), t1
            tool.set_attr("tool_name", name)
            tool.set_attr("timing", "trl_batch")
            out_spans.append(tool)
    return out_spans


def _tool_result(content: Any) -> Any:
    """A tool message's content; TRL writes a failed call as ``str({"error": message})``:
    that becomes ``{"content": ..., "error": message}``, which every reader counts as failed."""
    if content is None:
        return {"content": None, "error": "no result (TRL dropped it: too long)"}
    if isinstance(content, str) and content.startswith("{'error': "):
        try:
            parsed = ast.literal_eval(content)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, dict) and set(parsed) == {"error"}:
            return {"content": content, "error": str(parsed["error"])}
    return content if isinstance(content, str) else {"content": content}


def reward_span(root: int, completion: Any, scores: dict[str, float | None],
                total: float | None, start: int) -> Span:  # fmt: skip
    """The reward span: each reward function's value under its name (the reward parts, as a
    verl reward function's extra keys), then the weighted sum TRL trains on under ``score``
    (``reward`` when a reward function is itself named ``score``)."""
    text = completion
    if isinstance(completion, list):
        text = next((_text(m.get("content")) for m in reversed(completion)
                     if m.get("role") == "assistant"), None)  # fmt: skip
    span = Span("reward", "reward", root, {"solution_str": text}, start)
    key = next((k for k in _TOTAL_KEYS if k not in scores), "trl_weighted_sum")
    span.outputs = {**scores, key: total}
    span.set_attr("weighted_sum_key", key)  # which output is the sum (see _TOTAL_KEYS)
    span.end_ns = start
    return span


def _text(content: Any) -> Any:
    if isinstance(content, list):  # content blocks: their text parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content


def size(value: Any) -> int:
    return len(repr(value)) if value is not None else 0
