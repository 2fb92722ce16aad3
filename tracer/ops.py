"""The hot path: ``trace_attr`` opens a trajectory (tracer/scope.py), ``@trace_op`` records
spans inside it.

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
from time import time_ns
from typing import Any, TypeVar

from tracer.record import KINDS

# the scope's names, read here on every traced call (and imported from here by verl_compat)
from tracer.scope import (
    OUTSIDE,
    _current,
    current_trajectory,
    set_span_attributes,
    trace_attr,
)
from tracer.snapshot import snapshot, snapshot_args
from tracer.trajectory import Span, Trajectory

F = TypeVar("F", bound=Callable[..., Any])


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


__all__ = ["OUTSIDE", "_current", "current_trajectory", "set_span_attributes", "trace_attr",
           "trace_op"]  # fmt: skip
