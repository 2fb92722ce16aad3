"""The data types of a trajectory being recorded: the bottom of the house.

The hot path (``tracer.ops``) produces them; the pipeline and the record builder
(``tracer.record_builder``) consume them. They hold raw snapshots only (``tracer.snapshot``:
plain data already as its JSON, anything else copied): rendering, decoding and the record's
serialization happen off the hot path.
"""

from __future__ import annotations

from time import time_ns
from typing import Any

from tracer.attempts import identity_key
from tracer.ids import (
    attempt_trace_id,
    derived_span_id,
    derived_trace_id,
    new_span_id,
    new_trace_id,
)


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

    def __init__(
        self, name: str, kind: str, parent_id: int | None, inputs: Any, start_ns: int = 0
    ) -> None:
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
        self.start_ns = start_ns or time_ns()

    def set_attr(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value


class Trajectory:
    """A trajectory being recorded. Only the tracer's own code touches its fields.

    Opening one is on the hot path (``trace_attr``), so it holds its root span as plain fields
    (name, id, start, end, error) and makes the root ``Span`` only when asked, normally by the
    record builder in the background; ``spans`` holds the spans recorded under it, in the order
    they opened. Its trace id is made when first asked for too: a random one, or one derived
    from the run's salt and the trajectory's identity, attempt included (``tracer.annotate``
    needs that; ``tracer.attempts`` numbers the attempts)."""

    __slots__ = (
        "_root",
        "_trace_id",
        "attempt",
        "attributes",
        "end_ns",
        "error",
        "hot_ns",
        "name",
        "nbytes",
        "policy_version",
        "rollout_n",
        "root_id",
        "sample_index",
        "spans",
        "start_ns",
        "step",
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
        attempt: int | None = None,
    ) -> None:
        self.tracer = tracer
        self.name = name
        self.step = step
        self.sample_index = sample_index
        self.rollout_n = rollout_n
        self.validate = validate
        self.policy_version = policy_version
        self.attributes = attributes
        self.root_id = new_span_id()
        self.spans: list[Span] = []
        self.nbytes = 512
        self.hot_ns = 0  # time spent in the tracer's own hot-path code (a metric)
        self.error: BaseException | None = None
        self._root: Span | None = None
        self._trace_id: str | None = None
        self.end_ns = 0
        self.attempt = attempt or 0
        if self._salt():  # a derived id: a retry of this identity must not get the same one
            self.attempt = tracer.attempts.take(
                step, identity_key(sample_index, rollout_n, validate), attempt
            )
        self.start_ns = time_ns()

    @property
    def root(self) -> Span:
        """The root span, made on first use and kept in step with the trajectory's fields."""
        root = self._root
        if root is None:
            root = Span(self.name, "trajectory", None, None, self.start_ns)
            root.span_id = self.root_id
            root.end_ns = self.end_ns
            root.error = self.error
            return root
        return root

    def make_root(self, span: Span) -> None:
        """Make ``span``, one recorded under this trajectory, its root (verl's shim: an op
        called outside any trajectory is the root of its own trace)."""
        self.spans.remove(span)
        span.parent_id = None
        self.root_id = span.span_id
        self._root = span

    def all_spans(self) -> list[Span]:
        """The root, then every span under it."""
        return [self.root, *self.spans]

    def _salt(self) -> str | None:
        salt = getattr(getattr(self.tracer, "config", None), "run_salt", None)
        if salt and has_identity(self.step, self.sample_index, self.rollout_n):
            return str(salt)
        return None

    @property
    def trace_id(self) -> str:
        """32 hex digits, fixed once made."""
        tid = self._trace_id
        if tid is None:
            salt = self._salt()
            if salt:
                config = self.tracer.config
                tid = derived_trace_id(salt, config.project_name, config.experiment_name,
                                       self.step, self.sample_index, self.rollout_n,
                                       bool(self.validate))  # fmt: skip
                tid = attempt_trace_id(tid, self.attempt)
            else:
                tid = f"{new_trace_id():032x}"
            self._trace_id = tid
        return tid

    def settle_ids(self) -> str:
        """Fix the trace id and, for a derived trace, the root span's id (an annotation written
        later by another process names that span as its parent); the spans opened under the
        root follow it. Called once the trajectory has ended, before its record is built."""
        tid = self.trace_id
        if self._salt():
            old = self.root_id
            new = int(derived_span_id(tid, "root"), 16)
            if new != old:
                self.root_id = new
                if self._root is not None:
                    self._root.span_id = new
                for span in self.spans:
                    if span.parent_id == old:
                        span.parent_id = new
        return tid
