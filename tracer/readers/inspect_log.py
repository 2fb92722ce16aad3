"""Trajectories as Inspect eval logs (``inspect-ai``), for ``inspect view`` and Docent.

One log per step (validation steps in their own: ``step-000003.eval``,
``val-step-000003.eval``), written with Inspect's own API (``inspect_ai.log.write_eval_log``).
Each trajectory is a sample:

- ``id`` its ``sample_index`` and ``epoch`` its ``rollout_n`` + 1, so ``inspect view`` shows a
  GRPO group as the epochs of one sample (a clash, e.g. two workers' sample 0, falls back to
  ``"<sample_index>-<trace id>"``);
- ``messages`` the whole chat (:func:`tracer.chat.conversation`): system/user messages,
  assistant replies with their tool calls, every tool result, those after the last reply too
  (a failed tool's error as the message's ``error``);
- ``events`` what Inspect's Transcript tab shows (:mod:`tracer.readers.inspect_events`): a
  model event per generate call, a tool event per tool call, the reward's score event;
- ``error`` the exception a trajectory that raised ended with (type, message, traceback);
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
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tracer.chat import conversation
from tracer.readers.health import analyze
from tracer.readers.inspect_events import STOP, arguments, sample_events, tool_error
from tracer.readers.rows import records_rows
from tracer.record import SpanRecord, TrajectoryRecord
from tracer.tokens import LOGPROBS_ATTR, decode_floats


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

    chat = conversation(record)
    messages = [_message(m, span) for m, span in chat]
    first_reply = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    input_messages = messages[:first_reply] if first_reply else messages[:1]
    replies = [m for m in messages if m.role == "assistant"]
    finish = _last_finish(record)
    output = (
        ModelOutput.from_message(replies[-1], stop_reason=STOP.get(finish, "unknown"))
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
    error = _error(record)
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
        error=error,
        events=sample_events(record, chat, messages, model_name(record), error),
    )


def _error(record: TrajectoryRecord) -> Any:
    """The ``EvalError`` of a trajectory that raised (its root span's error), else None."""
    from inspect_ai.log import EvalError

    failed = record.spans[0].error if record.spans and record.status == "ERROR" else None
    if failed is None:
        return None
    trace = str(failed.get("traceback") or "")
    message = f"{failed.get('type', 'Error')}: {failed.get('message', '')}"
    return EvalError(message=message, traceback=trace, traceback_ansi=trace)


def model_name(record: TrajectoryRecord) -> str:
    """The model of the first generate call that names one, else ``rollout/<experiment>``."""
    for span in record.spans:
        if span.kind == "generate" and isinstance(span.inputs, dict):
            model = span.inputs.get("model")
            if isinstance(model, str):
                return model
    return f"rollout/{record.experiment_name}"


def _message(message: dict[str, Any], span: SpanRecord | None) -> Any:
    from inspect_ai.model import (
        ChatMessageAssistant,
        ChatMessageSystem,
        ChatMessageTool,
        ChatMessageUser,
    )
    from inspect_ai.tool import ToolCall

    role, content = message["role"], message.get("content") or ""
    if role == "system":
        return ChatMessageSystem(content=content)
    if role == "assistant":
        calls = [
            ToolCall(
                id=c["id"], function=c["function"]["name"],
                arguments=arguments(c["function"]["arguments"]),
            )
            for c in message.get("tool_calls", [])
        ]  # fmt: skip
        logprobs = decode_floats(span.attributes.get(LOGPROBS_ATTR)) if span is not None else None
        return ChatMessageAssistant(
            content=content, tool_calls=calls or None,
            metadata={"logprobs": logprobs} if logprobs else None,
        )  # fmt: skip
    if role == "tool":
        error = tool_error(span) if span is not None and span.kind == "tool" else None
        return ChatMessageTool(
            content=content, tool_call_id=message.get("tool_call_id"),
            function=message.get("name"), error=error,
        )  # fmt: skip
    return ChatMessageUser(content=content)


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
        EvalStats,
    )

    first = records[0]
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
        model=model_name(first),
        config=EvalConfig(epochs=epochs),
        metadata={
            "step": first.step,
            "validate": bool(first.validate),
            "source": "rollout-tracer",
        },
    )
    completed = sum(s.error is None for s in samples)
    results = EvalResults(total_samples=len(samples), completed_samples=completed, scores=scores)
    # the run's span, so inspect view shows a duration
    stats = EvalStats(started_at=_iso(min(r.start_ns for r in records)),
                      completed_at=_iso(max(r.end_ns for r in records)))  # fmt: skip
    return EvalLog(eval=spec, status="success", results=results, stats=stats, samples=samples)
