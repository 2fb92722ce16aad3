"""Background stage: a finished raw trajectory -> a TrajectoryRecord (decoded, bounded,
JSON-able)."""

from __future__ import annotations

import math
import traceback
from typing import TYPE_CHECKING, Any

from tracer.jsonable import Limits, render_snapshot, safe_repr, to_jsonable
from tracer.record import SpanRecord, TrajectoryRecord, end_reason_of, is_aborted, is_verl_style
from tracer.snapshot import ObjectSnapshot, Truncated
from tracer.token_text import as_id_list, find_field, response_count, token2text, verl_token2text
from tracer.tokens import LOGPROBS_ATTR, as_float_list, encode_floats

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.trajectory import Span, Trajectory

_REWARD_KEYS = ("reward", "score", "reward_score", "acc")
# where a generate call's result holds per-token log-probs: ours, verl's TokenOutput, vLLM's
_LOGPROB_FIELDS = ("logprobs", "log_probs", "response_logprobs")


def build_record(traj: Trajectory, config: TraceConfig, tokenizer: Any) -> TrajectoryRecord:
    """The trajectory's record. Plain data the hot path took as JSON stays :data:`Json` in
    it (``tracer.encode`` writes those bytes as they are; ``TrajectoryRecord.materialize``
    decodes them for backends that want Python values)."""
    verl = is_verl_style(traj.attributes)
    # verl's backends write objects as their fields (pydantic's model_dump), without a type key
    limits = Limits(config.max_field_chars, config.max_list_items, type_keys=not verl)
    trace_id = traj.settle_ids()  # before the spans are read: a derived root id moves
    recorded = traj.all_spans()
    root = recorded[0]
    reward: float | None = None
    spans: list[SpanRecord] = []
    rollout_logprobs: list[float] = []
    tokenizer = tokenizer if tokenizer is not None else trajectory_tokenizer(traj)
    reason = end_reason_of(None, traj.error)
    aborted = False  # the last generate call came back aborted by the engine (verl, vLLM)
    for span in recorded:
        attrs = _to_attrs(span.attributes, limits)
        end_ns = span.end_ns
        if end_ns == 0:  # still open when the trajectory ended (abandoned generator, leaked task)
            end_ns = root.end_ns or span.start_ns
            attrs["unfinished"] = True
        if span is not root and (span.end_ns == 0 or (
                span.error is not None and end_reason_of(None, span.error) != "error")):
            attrs["cut"] = True  # ended by the cancel or timeout that ended the trajectory
        inputs = render_snapshot(span.inputs, limits)
        outputs = render_snapshot(span.outputs, limits)
        if config.token2text and verl:
            verl_token2text(span, outputs, attrs, span.tokenizer or tokenizer, limits)
        elif config.token2text:
            token2text(span, inputs, outputs, attrs, span.tokenizer or tokenizer, limits)
        if span.kind == "reward" and span.error is None:
            value = _reward_value(span.outputs)
            if value is not None:
                attrs["reward"] = value
                reward = value
        if span.kind == "generate":
            finish = find_field(span.outputs, "finish_reason")
            if finish is not None:
                attrs["finish_reason"] = (
                    safe_repr(finish, limits) if not isinstance(finish, str) else finish
                )
            lps = _encode_logprobs(span, outputs, attrs)
            if lps:
                rollout_logprobs.extend(lps)
            if span.error is None:
                aborted = is_aborted(finish) or is_aborted(find_field(span.outputs,
                                                                      "stop_reason"))
        if span.kind == "tool":
            attrs.setdefault("tool_name", _tool_name(span))
        parent = span.parent_id
        spans.append(  # positional, in SpanRecord's field order: keywords cost 3.5x more
            SpanRecord(
                "%016x" % span.span_id,  # noqa: UP031 (twice as fast as an f-string here)
                "%016x" % parent if parent is not None else None,  # noqa: UP031
                span.name,
                span.kind,
                span.start_ns,
                end_ns,
                "ERROR" if span.error is not None else "OK",
                _error_dict(span.error, limits) if span.error is not None else None,
                inputs,
                outputs,
                attrs,
            )
        )
    explicit = traj.attributes.get("reward")
    if explicit is not None:
        reward = _as_float(explicit)
    _fill_root(spans, reward)
    attributes = {
        str(k): to_jsonable(v, limits) for k, v in traj.attributes.items() if k != "reward"
    }
    if reason == "completed" and aborted:
        reason = "cancelled"  # verl drops a sample its engine aborted (no partial rollout)
    # why it ended (and a dropped one's length so far): root span attributes and trace tags
    ended: dict[str, Any] = {"end_reason": reason}
    if reason != "completed":  # counted here for drops only: readers count the others' spans
        counts = [response_count(span.outputs, record.attributes) for span, record in
                  zip(recorded, spans, strict=True) if span.kind == "generate"
                  and span.error is None]  # fmt: skip
        if any(n is not None for n in counts):
            ended["response_tokens"] = sum(n for n in counts if n is not None)
    spans[0].attributes.update(ended)
    attributes.update(ended)
    if rollout_logprobs:  # per trajectory: root span attributes and (filterable) trace tags
        finite = [v for v in rollout_logprobs if math.isfinite(v)]
        if finite:
            summary = {"logprob_min": min(finite), "logprob_mean": sum(finite) / len(finite)}
            spans[0].attributes.update(summary)
            attributes.update({k: round(v, 6) for k, v in summary.items()})
    return TrajectoryRecord(  # positional, in the dataclass's field order
        trace_id,
        root.name,
        config.project_name,
        config.experiment_name,
        _as_int_or_none(traj.step),
        to_jsonable(traj.sample_index, limits),
        to_jsonable(traj.rollout_n, limits),
        bool(traj.validate),
        config.worker_id,
        root.start_ns,
        root.end_ns or root.start_ns,
        spans[0].status,
        reward,
        to_jsonable(traj.policy_version, limits),
        traj.attempt,
        attributes,
        spans,
    )


def _encode_logprobs(span: Span, outputs: Any, attrs: dict[str, Any]) -> list[float] | None:
    """The engine's per-token log-probs of a generate span -> one compact attribute
    (``tracer.tokens`` encoding) plus their min and mean; the outputs keep a short marker in
    their place, so the span view stays readable."""
    for name in _LOGPROB_FIELDS:
        raw = find_field(span.outputs, name)
        if raw is not None:
            break
    else:
        return None
    if isinstance(raw, Truncated):
        raw = raw.items
    try:
        values = _logprob_list(raw, span.outputs)
    except (TypeError, ValueError, AttributeError):
        return None
    if not values:
        return None
    attrs[LOGPROBS_ATTR] = encode_floats(values)
    finite = [v for v in values if math.isfinite(v)]
    if finite:
        attrs["logprob_min"] = min(finite)
        attrs["logprob_mean"] = sum(finite) / len(finite)
    if isinstance(outputs, dict) and name in outputs:
        outputs[name] = f"<{len(values)} log-probs: float32 base64 in attribute {LOGPROBS_ATTR}>"
    return values


def _logprob_list(raw: Any, outputs: Any) -> list[float] | None:
    """Floats from a list/array of numbers, or from vLLM's per-position ``{token_id:
    Logprob}`` dicts (the sampled token's entry, by the response's ids in ``outputs``)."""
    if isinstance(raw, list) and raw and isinstance(raw[0], dict):
        token_ids = find_field(outputs, "response_ids")
        if token_ids is None:
            token_ids = find_field(outputs, "token_ids")
        ids = as_id_list(token_ids)[0] if token_ids is not None else []
        out = []
        for i, entry in enumerate(raw):
            hit = entry.get(ids[i]) if i < len(ids) else None
            if hit is None and entry:
                hit = next(iter(entry.values()))
            if isinstance(hit, ObjectSnapshot):
                hit = hit.fields.get("logprob")
            elif hit is not None and hasattr(hit, "logprob"):
                hit = hit.logprob
            out.append(float(hit) if hit is not None else math.nan)
        return out
    return as_float_list(raw)


def trajectory_tokenizer(traj: Trajectory) -> Any:
    """The tokenizer of the trajectory's first span that has one (its generate spans take
    their owner's ``tokenizer``), so token2text also decodes the ids the root and other
    spans carry; None when no span has one."""
    for span in traj.spans:
        if span.tokenizer is not None:
            return span.tokenizer
    return None


def _to_attrs(raw: dict[str, Any] | None, limits: Limits) -> dict[str, Any]:
    return {k: to_jsonable(v, limits) for k, v in raw.items()} if raw else {}


def _as_int_or_none(x: Any) -> int | None:
    if x is None:
        return None
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _as_float(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    try:
        if type(x).__module__ in ("numpy", "torch") and hasattr(x, "item"):
            x = x.item()
        value = float(x)
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


def _reward_value(out: Any) -> float | None:
    if isinstance(out, (dict, ObjectSnapshot)):
        for key in _REWARD_KEYS:
            value = find_field(out, key)
            if value is not None:
                return _as_float(value)
        return None
    return _as_float(out)


def _tool_name(span: Span) -> str:
    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    for key in ("name", "tool_name", "tool"):
        value = inputs.get(key)
        if isinstance(value, str):
            return value
    return span.name


def _error_dict(exc: BaseException, limits: Limits) -> dict[str, Any]:
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        tb = "<traceback unavailable>"
    try:
        message = str(exc)
    except Exception:
        message = safe_repr(exc, limits)
    return {
        "type": type(exc).__name__,
        "message": message[: limits.max_chars],
        "traceback": tb[-limits.max_chars :],
    }


def _fill_root(spans: list[SpanRecord], reward: float | None) -> None:
    """The root (``trace_attr``) has no arguments of its own: show the first direct child's
    inputs and the last one's outputs, so a trace list reads as prompt -> response, reward."""
    root = spans[0]
    children = [s for s in spans[1:] if s.parent_id == root.span_id]
    if root.inputs is None and children:
        root.inputs = children[0].inputs
    if root.outputs is None:
        last = children[-1].outputs if children else None
        root.outputs = {"reward": reward, "output": last} if reward is not None else last
