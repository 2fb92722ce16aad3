"""Trajectories as Inspect eval logs (``inspect-ai``), for ``inspect view`` and Docent.

One log per step (validation steps in their own: ``step-000003.eval``,
``val-step-000003.eval``), written with Inspect's own API (``inspect_ai.log.write_eval_log``).
Each trajectory is a sample:

- ``id`` its ``sample_index`` and ``epoch`` its ``rollout_n`` + 1, so ``inspect view`` shows a
  GRPO group as the epochs of one sample (a clash, e.g. two workers' sample 0, falls back to
  ``"<sample_index>-<trace id>"``);
- ``messages`` the whole chat (:func:`tracer.chat.conversation`): system/user messages,
  assistant replies with their tool calls, tool results (a failed tool span's error too);
- ``scores["reward"]`` the reward; ``metadata`` the trajectory's tags (step, sample_index,
  rollout_n, validate, experiment, worker, policy version, user attributes), its trace id, its
  health ``flags``, and ``logprobs``: the engine's per-token log-probs of all its replies in
  order where they were traced (each assistant message also carries its own in its metadata).

Inspect writes a log in one go, so the samples of every step are held until the source has
been read (a step of a few thousand trajectories is tens of MB).

    from tracer.readers.inspect_log import export_inspect
    export_inspect(iter_records("jsonl", path="traces/gsm8k/grpo.jsonl"), "exports/inspect")
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tracer.chat import conversation
from tracer.readers.health import analyze
from tracer.readers.rows import records_rows
from tracer.record import SpanRecord, TrajectoryRecord
from tracer.tokens import LOGPROBS_ATTR, decode_floats

_STOP: dict[str, Any] = {"stop": "stop", "length": "max_tokens", "tool_calls": "tool_calls"}


@dataclass
class InspectSummary:
    """What an Inspect export wrote: samples per log file."""

    files: dict[str, int] = field(default_factory=dict)


def log_name(step: int | None, validate: bool) -> str:
    stem = "nostep" if step is None else f"step-{step:06d}"
    return f"{'val-' if validate else ''}{stem}.eval"


def export_inspect(
    pages: Iterable[list[TrajectoryRecord]],
    out: str,
    on_page: Callable[[int], None] | None = None,
) -> InspectSummary:
    """Write one Inspect eval log per (step, validate) of the records in ``pages`` to ``out``."""
    try:
        from inspect_ai.log import write_eval_log
    except ImportError as exc:
        raise ImportError(
            "the inspect format needs inspect-ai: pip install 'rollout-tracer[inspect]'"
        ) from exc
    os.makedirs(out, exist_ok=True)
    groups: dict[tuple[int | None, bool], list[tuple[TrajectoryRecord, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for page in pages:
        rows.extend(records_rows(page).trajectories)
        for record in page:
            groups.setdefault((record.step, bool(record.validate)), []).append(
                (record, to_sample(record))
            )
        if on_page is not None:
            on_page(len(page))
    flags = analyze(rows).by_trace
    summary = InspectSummary()
    for (step, validate), items in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        seen: set[tuple[Any, int]] = set()
        for record, sample in items:
            sample.metadata["flags"] = list(flags.get(record.trace_id, []))
            if (sample.id, sample.epoch) in seen:
                sample.id = f"{record.sample_index}-{record.trace_id}"
            seen.add((sample.id, sample.epoch))
        path = os.path.join(out, log_name(step, validate))
        write_eval_log(_log([r for r, _ in items], [s for _, s in items]), path, format="eval")
        summary.files[path] = len(items)
    return summary


def _order(key: tuple[int | None, bool]) -> tuple[bool, int]:
    step, validate = key
    return (validate, -1 if step is None else step)


def to_sample(record: TrajectoryRecord) -> Any:
    """One trajectory as an ``inspect_ai.log.EvalSample``."""
    from inspect_ai.log import EvalSample
    from inspect_ai.model import ModelOutput
    from inspect_ai.scorer import Score

    messages = [_message(m, span) for m, span in conversation(record)]
    first_reply = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    input_messages = messages[:first_reply] if first_reply else messages[:1]
    replies = [m for m in messages if m.role == "assistant"]
    finish = _last_finish(record)
    output = (
        ModelOutput.from_message(replies[-1], stop_reason=_STOP.get(finish, "unknown"))
        if replies
        else ModelOutput()
    )
    metadata: dict[str, Any] = {
        **record.tags(),
        "step": record.step,
        "sample_index": record.sample_index,
        "rollout_n": record.rollout_n,
        "validate": bool(record.validate),
        "trace_id": record.trace_id,
        "name": record.name,
        "status": record.status,
    }
    logprobs = [v for m in replies for v in (m.metadata or {}).get("logprobs", [])]
    if logprobs:
        metadata["logprobs"] = logprobs
    rollout_n = record.rollout_n
    return EvalSample(
        id=record.sample_index if isinstance(record.sample_index, (int, str)) else record.trace_id,
        epoch=rollout_n + 1 if isinstance(rollout_n, int) and rollout_n >= 0 else 1,
        input=input_messages or "",
        target="",
        messages=messages,
        output=output,
        scores={} if record.reward is None else {"reward": Score(value=float(record.reward))},
        metadata=metadata,
        started_at=_iso(record.start_ns),
        completed_at=_iso(record.end_ns),
        total_time=(record.end_ns - record.start_ns) / 1e9,
        error=None,
    )


def _message(message: dict[str, Any], span: SpanRecord | None) -> Any:
    from inspect_ai.model import (
        ChatMessageAssistant,
        ChatMessageSystem,
        ChatMessageTool,
        ChatMessageUser,
    )
    from inspect_ai.tool import ToolCall, ToolCallError

    role, content = message["role"], message.get("content") or ""
    if role == "system":
        return ChatMessageSystem(content=content)
    if role == "assistant":
        calls = [
            ToolCall(
                id=c["id"], function=c["function"]["name"],
                arguments=_arguments(c["function"]["arguments"]),
            )
            for c in message.get("tool_calls", [])
        ]  # fmt: skip
        logprobs = decode_floats(span.attributes.get(LOGPROBS_ATTR)) if span is not None else None
        return ChatMessageAssistant(
            content=content, tool_calls=calls or None,
            metadata={"logprobs": logprobs} if logprobs else None,
        )  # fmt: skip
    if role == "tool":
        error = None
        if span is not None and span.error is not None:
            error = ToolCallError("unknown", str(span.error.get("message", "")))
        return ChatMessageTool(
            content=content, tool_call_id=message.get("tool_call_id"),
            function=message.get("name"), error=error,
        )  # fmt: skip
    return ChatMessageUser(content=content)


def _arguments(arguments: Any) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _last_finish(record: TrajectoryRecord) -> str:
    for span in reversed(record.spans):
        if span.kind == "generate" and isinstance(span.attributes.get("finish_reason"), str):
            return str(span.attributes["finish_reason"])
    return "stop"


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).isoformat()


def _log(records: list[TrajectoryRecord], samples: list[Any]) -> Any:
    from inspect_ai.log import (
        EvalConfig,
        EvalDataset,
        EvalLog,
        EvalMetric,
        EvalResults,
        EvalScore,
        EvalSpec,
    )

    first = records[0]
    models = [
        s.inputs["model"]
        for r in records[:1]
        for s in r.spans
        if s.kind == "generate"
        and isinstance(s.inputs, dict)
        and isinstance(s.inputs.get("model"), str)
    ]
    rewards = [float(r.reward) for r in records if r.reward is not None]
    epochs = max((s.epoch for s in samples), default=1)
    scores = []
    if rewards:
        metrics = {
            "mean": EvalMetric(name="mean", value=sum(rewards) / len(rewards)),
            "max": EvalMetric(name="max", value=max(rewards)),
        }
        scores.append(EvalScore(name="reward", scorer="reward", metrics=metrics))
    spec = EvalSpec(
        created=_iso(min(r.start_ns for r in records)),
        task=f"{first.experiment_name}/{log_name(first.step, bool(first.validate))[:-5]}",
        dataset=EvalDataset(name=first.experiment_name, samples=len({s.id for s in samples})),
        model=models[0] if models else f"rollout/{first.experiment_name}",
        config=EvalConfig(epochs=epochs),
        metadata={
            "step": first.step,
            "validate": bool(first.validate),
            "source": "rollout-tracer",
        },
    )
    results = EvalResults(total_samples=len(samples), completed_samples=len(samples), scores=scores)
    return EvalLog(eval=spec, status="success", results=results, samples=samples)
