"""The data types of a trajectory being recorded: the bottom of the house.

The hot path (``tracer.ops``) produces them; the pipeline and the record builder
(``tracer.build``) consume them. They hold raw snapshots only: rendering, decoding and
serialization happen off the hot path.
"""

from __future__ import annotations

import time
from typing import Any

from tracer.ids import derived_span_id, derived_trace_id, new_span_id, new_trace_id


def has_identity(step: Any, sample_index: Any, rollout_n: Any) -> bool:
    """Whether a trajectory's identity is complete enough to derive its trace id from: a step,
    a rollout_n, and a sample_index the caller gave (not one the sampler numbered)."""
    return (
        step is not None
        and rollout_n is not None
        and sample_index is not None
        and not (isinstance(sample_index, str) and sample_index.startswith("auto-"))
    )


class Span:
    """One recorded call: raw snapshots of its inputs and outputs, rendered later."""

    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "inputs",
        "kind",
        "name",
        "outputs",
        "parent_id",
        "span_id",
        "start_ns",
        "tokenizer",
    )

    def __init__(self, name: str, kind: str, parent_id: int | None, inputs: Any) -> None:
        self.span_id = new_span_id()  # tracer/ids.py; formatted as hex off the hot path
        self.parent_id = parent_id
        self.name = name
        self.kind = kind
        self.inputs = inputs
        self.outputs: Any = None
        self.error: BaseException | None = None
        self.attributes: dict[str, Any] | None = None
        self.tokenizer: Any = None
        self.end_ns = 0
        self.start_ns = time.time_ns()

    def set_attr(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value


class Trajectory:
    """A trajectory being recorded. Only the tracer's own code touches its fields."""

    __slots__ = (
        "attributes",
        "hot_ns",
        "nbytes",
        "policy_version",
        "rollout_n",
        "root",
        "sample_index",
        "spans",
        "step",
        "trace_id",
        "tracer",
        "validate",
    )

    def __init__(
        self,
        tracer: Any,
        name: str,
        step: Any,
        sample_index: Any,
        rollout_n: Any,
        validate: bool,
        policy_version: Any,
        attributes: dict[str, Any],
    ) -> None:
        self.tracer = tracer
        salt = getattr(getattr(tracer, "config", None), "run_salt", None)
        if salt and has_identity(step, sample_index, rollout_n):
            config = tracer.config
            self.trace_id = derived_trace_id(salt, config.project_name, config.experiment_name,
                                             step, sample_index, rollout_n, bool(validate))
        else:
            self.trace_id = f"{new_trace_id():032x}"
        self.step = step
        self.sample_index = sample_index
        self.rollout_n = rollout_n
        self.validate = validate
        self.policy_version = policy_version
        self.attributes = attributes
        self.root = Span(name, "trajectory", None, None)
        if salt and has_identity(step, sample_index, rollout_n):
            # an annotation written later by another process names this span as its parent
            self.root.span_id = int(derived_span_id(self.trace_id, "root"), 16)
        self.spans: list[Span] = [self.root]
        self.nbytes = 512
        self.hot_ns = 0  # time spent in the tracer's own hot-path code (a metric)
