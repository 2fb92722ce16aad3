"""The trajectory's scope: ``trace_attr`` opens a trajectory and holds it in a context
variable for the ops nested inside (``tracer.ops`` reads it on every traced call);
``current_trajectory`` and ``set_span_attributes`` read it. What a trajectory holds when it ends
goes to the tracer's buffer, whose put never blocks.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from time import time_ns
from typing import Any

import tracer.current as _current_tracer
from tracer.trajectory import Trajectory

# What the context variable holds: (trajectory, parent span id). A plain tuple: one is made for
# every traced call, and building a tuple costs a fraction of an object's __init__. The
# trajectory is None when not traced; the sentinels differ in their second item so that they
# stay distinct objects (equal constant tuples would be folded into one).
_Frame = tuple[Any, Any]
OUTSIDE: _Frame = (None, 0)  # outside any trace_attr
_NOT_TRACED: _Frame = (None, None)  # inside one that is not sampled, or tracing off
_DISABLED: _Frame = (None, -1)  # inside trace_attr(trace=False): nested trajectories stay off
_current: ContextVar[_Frame] = ContextVar("rollout_tracer_frame", default=OUTSIDE)


def current_trajectory() -> Trajectory | None:
    """The trajectory open in this context (``trace_id``, ``step``, ``sample_index``, ...), or
    None outside ``trace_attr`` and when tracing is off. Read it; the tracer owns its fields."""
    traj: Trajectory | None = _current.get()[0]
    return traj


def set_span_attributes(**attributes: Any) -> None:
    """Add attributes to the span of the traced op running now (the innermost one), e.g. the
    JSON schema of the tool a dispatcher runs (``tool_schema``, written by the OTLP backend as
    OpenInference ``tool.parameters``). Values are kept as given, not copied, and rendered in
    the background: pass values that do not change afterwards. Outside a traced op (or a
    sampled trajectory) it does nothing.

    Example::

        @tracer.trace_op(kind="tool")
        async def call_tool(self, name: str, arguments: dict) -> str:
            tracer.set_span_attributes(tool_schema=self.tools[name].parameters)
    """
    traj, span_id = _current.get()
    if traj is None:
        return
    for span in reversed(traj.spans):  # the innermost op is nearly always the last opened
        if span.span_id == span_id:
            for key, value in attributes.items():
                span.set_attr(key, value)
            return


class trace_attr:
    """Open one trajectory: the root span of one trace, with its step and sample attributes.

    Works as ``with`` and ``async with``; contextvars carry it into nested calls and asyncio
    tasks. ``trace=False`` turns off every op nested inside. With ``run_salt`` set, a sample
    run again with the same identity is a new attempt (numbered in this process; pass
    ``attempt=`` when the retry runs in another process) with a trace id of its own.

    Example::

        with tracer.trace_attr(step=3, sample_index=i, rollout_n=k):
            await agent_loop.run(messages)
    """

    __slots__ = ("_start_ns", "_token", "_traj", "_watched", "kwargs")

    def __init__(
        self,
        step: Any = None,
        sample_index: Any = None,
        rollout_n: Any = None,
        validate: bool = False,
        name: str = "trajectory",
        trace: bool = True,
        policy_version: Any = None,
        attempt: int | None = None,
        **attributes: Any,
    ) -> None:
        if attempt is not None and (
            not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0
        ):
            raise ValueError(f"trace_attr: attempt must be an int >= 0, got {attempt!r}")
        self.kwargs = (
            step,
            sample_index,
            rollout_n,
            validate,
            name,
            trace,
            policy_version,
            attributes,
            attempt,
        )
        self._token: Token[_Frame] | None = None
        self._traj: Trajectory | None = None
        self._watched: dict[int, Any] | None = None  # the watchdog's, while unsampled and open
        self._start_ns = 0

    def __enter__(self) -> Trajectory | None:
        (step, sample_index, rollout_n, validate, name, trace, policy_version, attrs,
         attempt) = self.kwargs  # fmt: skip
        tracer = _current_tracer.tracer
        frame = _NOT_TRACED
        if not trace or _current.get() is _DISABLED:
            frame = _DISABLED
        elif tracer.active:
            traced, sample_index = tracer.admit(step, sample_index, validate)
            if traced:
                self._traj = traj = Trajectory(tracer, name, step, sample_index, rollout_n,
                                               bool(validate), policy_version, attrs,
                                               attempt)  # fmt: skip
                tracer.open_trajectories.add(traj)  # the watchdog's (tracer/watchdog.py)
                frame = (traj, traj.root_id)
            elif tracer.unsampled is not None:  # not recorded, but watched: a stuck rollout
                self._start_ns = time_ns()  # is reported all the same (tracer/watchdog.py)
                self._watched = watched = tracer.unsampled
                watched[id(self)] = self
        self._token = _current.set(frame)
        return self._traj

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._token is not None:
            try:
                _current.reset(self._token)
            except ValueError:  # exited in another context (a generator resumed elsewhere)
                _current.set(OUTSIDE)
            self._token = None
        watched = self._watched
        if watched is not None:
            self._watched = None
            watched.pop(id(self), None)
        traj = self._traj
        if traj is not None:
            self._traj = None
            traj.end_ns = time_ns()
            if exc is not None:
                traj.error = exc
            _cut_open_spans(traj)
            traj.tracer.open_trajectories.ended(traj)  # the watchdog's (tracer/watchdog.py)
            traj.tracer.submit(traj)

    async def __aenter__(self) -> Trajectory | None:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)


def _cut_open_spans(traj: Trajectory) -> None:
    """Close the spans still open as their trajectory ends (a tool call a timeout left running
    in its thread, a task nobody awaited) at the trajectory's end, marked ``cut``: the record
    keeps what the trajectory had when it ended, and the call's own late end is ignored."""
    for span in traj.spans:
        if not span.end_ns:
            span.end_ns = traj.end_ns
            span.set_attr("cut", True)
