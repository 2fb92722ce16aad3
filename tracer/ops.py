"""The hot path: ``trace_attr`` opens a trajectory, ``@trace_op`` records spans inside it.

Per call, a traced op only timestamps, snapshots its arguments and result (see
``tracer.snapshot``) and appends a span to its trajectory; an op outside a sampled trajectory
costs one context-variable read. Finished trajectories are handed to the tracer's buffer,
whose put never blocks. Everything expensive happens in the background pipeline.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from time import time_ns
from typing import Any, TypeVar

import tracer.current as _current_tracer
from tracer.record import KINDS
from tracer.snapshot import snapshot, snapshot_args
from tracer.trajectory import Span, Trajectory

F = TypeVar("F", bound=Callable[..., Any])


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


def _begin(traj: Trajectory, parent_id: int, op: _OpInfo, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Span:  # fmt: skip
    # One wall-clock read opens the span and starts the hot-path timer (tracer/trajectory.py:
    # hot_ns); the span's start includes its own snapshot, a microsecond or so.
    t0 = time_ns()
    tracer = traj.tracer
    config = tracer.config
    max_items, max_chars = config.max_list_items, config.max_field_chars
    try:
        names = op.fast_names
        if names is not None and len(args) <= len(names):
            # common case: positional-or-keyword parameters, no signature binding needed
            if op.is_method:
                inputs, nbytes = snapshot_args(names[1 : len(args)], args[1:], kwargs,
                                               max_items, max_chars)  # fmt: skip
            else:
                inputs, nbytes = snapshot_args(names, args, kwargs, max_items, max_chars)
        else:
            bound = op.signature.bind_partial(*args, **kwargs).arguments
            for skipped in op.skip:
                bound.pop(skipped, None)
            inputs, nbytes = snapshot_args((), (), bound, max_items, max_chars)
    except Exception as exc:  # arguments that do not bind: record, never fail the call
        inputs, nbytes = {"__bind_error__": f"{type(exc).__name__}: {exc}"}, 64
    if op.defaults and "__bind_error__" not in inputs:
        for pname, default in op.defaults:
            if pname not in inputs:
                inputs[pname] = snapshot(default, max_items, max_chars)[0]
    span = Span(op.name, op.kind, parent_id, inputs, t0)
    if op.on_begin is not None:
        op.on_begin(span, args, tracer)
    elif op.kind == "generate" and op.is_method and args and tracer.config.token2text:
        span.tokenizer = getattr(args[0], "tokenizer", None)
    traj.nbytes += nbytes + 256
    traj.spans.append(span)
    traj.hot_ns += time_ns() - t0
    return span


def _finish(traj: Trajectory, span: Span, result: Any) -> None:
    if span.end_ns:  # cut when its trajectory ended (_cut_open_spans): keep it as it was then
        return
    span.end_ns = t0 = time_ns()
    if type(result) is str:  # the most common result (a tool's): shared, only counted
        span.outputs = result
        traj.nbytes += len(result)
    else:
        config = traj.tracer.config
        span.outputs, nbytes = snapshot(result, config.max_list_items, config.max_field_chars)
        traj.nbytes += nbytes
    traj.hot_ns += time_ns() - t0


def _fail(span: Span, exc: BaseException) -> None:
    if span.end_ns:  # cut when its trajectory ended (_cut_open_spans)
        return
    span.end_ns = time.time_ns()
    span.error = exc


class _OpInfo:
    __slots__ = (
        "defaults",
        "fast_names",
        "is_method",
        "kind",
        "name",
        "on_begin",
        "signature",
        "skip",
    )

    def __init__(self, fn: Callable[..., Any], kind: str, name: str | None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown span kind {kind!r}; valid kinds: {sorted(KINDS)}")
        self.kind = kind
        self.name = name or fn.__name__
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        self.is_method = bool(params) and params[0].name in ("self", "cls")
        self.skip = frozenset({params[0].name}) if self.is_method else frozenset()
        simple = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.fast_names = tuple(p.name for p in params) if simple else None
        # Set by the verl shim (tracer.verl_compat), empty/None for native ops: parameters
        # recorded with their default when the call leaves them out, and a hook that runs
        # when the span opens (it sees the call's arguments, e.g. ``self.tokenizer``).
        self.defaults: tuple[tuple[str, Any], ...] = ()
        self.on_begin: Callable[[Span, tuple[Any, ...], Any], None] | None = None


def trace_op(kind: str = "other", name: str | None = None) -> Callable[[F], F]:
    """Record each call of the decorated function as a span of the current trajectory.

    Works on plain, async, generator and async-generator functions and methods. Inputs are
    the bound arguments without ``self``; the output is the return value (a generator's is
    the list of what it yielded). Exceptions pass through unchanged and mark the span ERROR.

    Example::

        @tracer.trace_op(kind="tool")
        async def call_tool(self, name: str, arguments: dict) -> str: ...
    """

    def decorate(fn: F) -> F:
        op = _OpInfo(fn, kind, name)
        if inspect.isasyncgenfunction(fn):
            wrapper: Callable[..., Any] = _wrap_async_gen(fn, op)
        elif inspect.iscoroutinefunction(fn):
            wrapper = _wrap_async(fn, op)
        elif inspect.isgeneratorfunction(fn):
            wrapper = _wrap_gen(fn, op)
        else:
            wrapper = _wrap_sync(fn, op)
        functools.update_wrapper(wrapper, fn)
        wrapper.__rollout_tracer_op__ = op  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _wrap_sync(fn: Callable[..., Any], op: _OpInfo) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        traj, parent_id = _current.get()
        if traj is None:
            return fn(*args, **kwargs)
        span = _begin(traj, parent_id, op, args, kwargs)
        token = _current.set((traj, span.span_id))
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            _current.reset(token)
        _finish(traj, span, result)
        return result

    return wrapper


def _wrap_async(fn: Callable[..., Any], op: _OpInfo) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        traj, parent_id = _current.get()
        if traj is None:
            return await fn(*args, **kwargs)
        span = _begin(traj, parent_id, op, args, kwargs)
        token = _current.set((traj, span.span_id))
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:  # CancelledError included: recorded, then re-raised
            _fail(span, exc)
            raise
        finally:
            _current.reset(token)
        _finish(traj, span, result)
        return result

    return wrapper


def _wrap_gen(fn: Callable[..., Any], op: _OpInfo) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        traj, parent_id = _current.get()
        if traj is None:
            return (yield from fn(*args, **kwargs))
        span = _begin(traj, parent_id, op, args, kwargs)
        inner = (traj, span.span_id)
        yielded: list[Any] = []
        gen = fn(*args, **kwargs)
        send: Any = None
        throw: BaseException | None = None
        try:
            while True:
                token = _current.set(inner)
                try:
                    item = gen.throw(throw) if throw is not None else gen.send(send)
                finally:
                    _current.reset(token)
                throw = None
                yielded.append(item)
                try:
                    send = yield item
                except GeneratorExit:
                    gen.close()
                    span.set_attr("generator_closed_early", True)
                    _finish(traj, span, yielded)
                    raise
                except BaseException as exc:
                    throw = exc
        except StopIteration as stop:
            if stop.value is not None:
                span.set_attr("return_value", stop.value)
            _finish(traj, span, yielded)
            return stop.value
        except GeneratorExit:
            raise
        except BaseException as exc:
            _fail(span, exc)
            span.outputs, _ = snapshot(yielded, traj.tracer.config.max_list_items,
                                          traj.tracer.config.max_field_chars)
            raise

    return wrapper


def _wrap_async_gen(fn: Callable[..., Any], op: _OpInfo) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        traj, parent_id = _current.get()
        if traj is None:
            # What ``yield from`` does for a generator, by hand: asend, athrow and aclose reach
            # the inner generator exactly, so a sampled-out call behaves like a traced one.
            plain = fn(*args, **kwargs)
            sent: Any = None
            thrown: BaseException | None = None
            try:
                while True:
                    if thrown is not None:
                        value = await plain.athrow(thrown)
                    else:
                        value = await plain.asend(sent)
                    thrown = None
                    try:
                        sent = yield value
                    except GeneratorExit:
                        await plain.aclose()
                        raise
                    except BaseException as exc:
                        thrown = exc
            except StopAsyncIteration:
                return
        span = _begin(traj, parent_id, op, args, kwargs)
        inner = (traj, span.span_id)
        yielded: list[Any] = []
        agen = fn(*args, **kwargs)
        send: Any = None
        throw: BaseException | None = None
        try:
            while True:
                token = _current.set(inner)
                try:
                    if throw is not None:
                        item = await agen.athrow(throw)
                    else:
                        item = await agen.asend(send)
                finally:
                    _current.reset(token)
                throw = None
                yielded.append(item)
                try:
                    send = yield item
                except GeneratorExit:
                    await agen.aclose()
                    span.set_attr("generator_closed_early", True)
                    _finish(traj, span, yielded)
                    raise
                except BaseException as exc:
                    throw = exc
        except StopAsyncIteration:
            _finish(traj, span, yielded)
        except GeneratorExit:
            raise
        except BaseException as exc:
            _fail(span, exc)
            span.outputs, _ = snapshot(yielded, traj.tracer.config.max_list_items,
                                          traj.tracer.config.max_field_chars)
            raise

    return wrapper
