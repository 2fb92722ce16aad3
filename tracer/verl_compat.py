"""verl's tracer API (``verl.utils.rollout_trace``) on top of ours: the same names, signatures
and singleton, and traces written the way verl writes them, so code written for verl runs
unchanged: swap the import, keep the calls.

Where the native API (``tracer.init``, ``trace_attr``, ``trace_op``) deliberately differs, the
shim still behaves like verl:

- ``RolloutTraceConfig`` is a singleton; a second ``init`` is ignored until ``reset()``.
- No sampling here. ``max_samples_per_step_per_worker`` is stored for the caller: verl's agent
  loop reads it, picks the traced samples itself and passes ``trace=`` to
  ``rollout_trace_attr``; the shim traces exactly what the caller selected.
- An op called outside any ``rollout_trace_attr`` is a trace of its own (the op is its root).
- Span names are qualified names (``ToolAgentLoop.run``); the span kind is read from verl's
  method names (``generate``, ``run``, ``extract_tool_calls``, ``execute``, ``*reward*``).
- Defaulted arguments are recorded; the ``validate`` tag is ``'True'``/``'False'``; token2text
  puts ``prompt_text``/``response_text`` in the op's outputs, decoded with ``self.tokenizer``;
  objects are written as their fields, without a ``__type__`` key.
- ``backend="dummy"`` (or ``None``) traces nothing. Unlike verl, an unknown backend name
  still fails at ``init`` (verl silently traces nothing).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

from tracer.config import ConfigError
from tracer.core import Tracer, get_tracer
from tracer.core import init as _init_tracer
from tracer.core import reset as _reset_tracer
from tracer.ops import OUTSIDE, _current, _OpInfo, trace_attr, trace_op
from tracer.record import STYLE_KEY
from tracer.trajectory import Span


class RolloutTraceConfig:
    """verl's trace configuration singleton.

    Example (verl's agent loop, call for call)::

        RolloutTraceConfig.init(project_name, experiment_name, "mlflow", True, 8)
        limit = RolloutTraceConfig.get_instance().max_samples_per_step_per_worker
    """

    _instance: ClassVar[RolloutTraceConfig | None] = None
    backend: str | list[str] | None = None
    token2text: bool = False
    project_name: str | None = None
    experiment_name: str | None = None
    max_samples_per_step_per_worker: int | None = None
    _initialized: bool = False
    _tracer: Tracer | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        instance = cls._instance
        if instance is not None and instance._initialized and instance._tracer is not get_tracer():
            # tracing was re-initialized or reset through the native API since: start over
            cls._instance = instance = None
        return instance if instance is not None else cls()

    @classmethod
    def init(
        cls,
        project_name: str | None,
        experiment_name: str | None,
        backend: str | list[str] | None,
        token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None,
        **options: Any,
    ) -> None:
        """Start tracing, once: later calls are ignored until :meth:`reset` (as in verl).
        ``options`` are extra :class:`tracer.TraceConfig` fields (``tracking_uri``, ...)."""
        config = cls.get_instance()
        if config._initialized:
            return
        n = max_samples_per_step_per_worker
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(
                "max_samples_per_step_per_worker must be None (trace all), 0 (trace none) "
                f"or a positive integer, got {n!r}"
            )
        names = {"project_name": project_name, "experiment_name": experiment_name}
        settings: dict[str, Any] = {k: v for k, v in names.items() if v is not None}
        settings.update(backend=backend, token2text=bool(token2text), **options)
        # The caller samples (verl's agent loop): the tracer keeps whatever it is given.
        settings["max_samples_per_step_per_worker"] = None
        config._tracer = _init_tracer(settings)
        config.backend = backend
        config.token2text = token2text
        config.project_name = project_name
        config.experiment_name = experiment_name
        config.max_samples_per_step_per_worker = max_samples_per_step_per_worker
        config._initialized = True

    @property
    def client(self) -> Any:
        """What verl's ``client`` holds: the ``mlflow`` or ``trackio`` module, the Weave client
        (the one the weave backend exports with), ``None`` when off; a dict for several."""
        if not self._initialized or self._tracer is None:
            return None
        clients = {name: _client(name) for name in self._tracer.config.backends}
        if len(clients) > 1:
            return clients
        return next(iter(clients.values()), None)

    @classmethod
    def get_backend(cls) -> str | list[str] | None:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> Any:
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool:
        return bool(cls.get_instance().token2text)

    @classmethod
    def reset(cls) -> None:
        """Forget the configuration and stop (flush) the tracing it started."""
        instance, cls._instance = cls._instance, None
        if instance is not None and instance._tracer is get_tracer():
            _reset_tracer()


def _client(backend: str) -> Any:
    if backend == "mlflow":
        import mlflow

        return mlflow
    if backend == "trackio":
        import trackio

        return trackio
    if backend == "weave":
        # the exporter's own client: it is never installed as weave's global client (that
        # one belongs to the user), so it is found on the pipeline's worker
        pipeline = get_tracer().pipeline
        for worker in pipeline.workers if pipeline is not None else ():
            client = getattr(worker.exporter, "client", None)
            if worker.name == "weave" and client is not None:
                return client
        from weave.trace.context.weave_client_context import get_weave_client

        return get_weave_client()
    return None


def rollout_trace_attr(
    sample_index: Any = None,
    step: Any = None,
    rollout_n: Any = None,
    name: str = "rollout_trace",
    validate: Any = False,
    trace: bool = True,
) -> trace_attr:
    """verl's ``rollout_trace_attr``: same parameters, same order. ``trace=False`` turns off
    every op inside; otherwise the trajectory is traced (the caller did the selection)."""
    style: dict[str, Any] = {STYLE_KEY: "verl"}
    return trace_attr(
        step=step,
        sample_index=sample_index,
        rollout_n=rollout_n,
        validate=bool(validate),
        name=name,
        trace=trace,
        **style,
    )


def span_kind(function_name: str) -> str:
    """The span kind of a verl method, from its name."""
    name = function_name.lower()
    if "extract_tool_calls" in name or "parse" in name:
        return "parse"
    if "generate" in name:
        return "generate"
    if "reward" in name or "score" in name:
        return "reward"
    if "tool" in name or name in ("execute", "call"):
        return "tool"
    if name in ("run", "arun") or name.startswith("run_"):
        return "trajectory"
    return "other"


def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """verl's bare decorator, for sync and async methods (and plain functions)."""
    native = trace_op(kind=span_kind(func.__name__), name=func.__qualname__)(func)
    op: _OpInfo = native.__rollout_tracer_op__  # type: ignore[attr-defined]
    op.defaults = _defaults(op)
    op.on_begin = _on_begin(op.is_method)
    name = op.name

    if inspect.iscoroutinefunction(func):

        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            if _current.get() is not OUTSIDE or not get_tracer().active:
                return await native(*args, **kwargs)
            with _OwnTrace(name):
                return await native(*args, **kwargs)

        wrapper: Callable[..., Any] = async_wrapper
    elif inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        return native  # verl has no generator ops; traced inside a trajectory only
    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _current.get() is not OUTSIDE or not get_tracer().active:
                return native(*args, **kwargs)
            with _OwnTrace(name):
                return native(*args, **kwargs)

    functools.update_wrapper(wrapper, func)
    wrapper.__rollout_tracer_op__ = op  # type: ignore[attr-defined]
    return wrapper


def _defaults(op: _OpInfo) -> tuple[tuple[str, Any], ...]:
    """What ``BoundArguments.apply_defaults`` adds, as verl records it: defaults, ``()`` for
    ``*args``, ``{}`` for ``**kwargs``."""
    out: list[tuple[str, Any]] = []
    params = list(op.signature.parameters.values())
    for p in params[1:] if op.is_method else params:
        if p.kind is p.VAR_POSITIONAL:
            out.append((p.name, ()))
        elif p.kind is p.VAR_KEYWORD:
            out.append((p.name, {}))
        elif p.default is not p.empty:
            out.append((p.name, p.default))
    return tuple(out)


def _on_begin(is_method: bool) -> Callable[[Span, tuple[Any, ...], Any], None]:
    """verl decodes with the op's own ``self.tokenizer``; a tool span is named by ``self.name``
    (verl's ``BaseTool.name``), so the export's tool_calls table has the tool's name."""

    def on_begin(span: Span, args: tuple[Any, ...], tracer: Any) -> None:
        if not is_method or not args:
            return
        obj = args[0]
        try:
            if tracer.config.token2text:
                span.tokenizer = getattr(obj, "tokenizer", None)
            if span.kind == "tool":
                tool_name = getattr(obj, "name", None)
                if isinstance(tool_name, str):
                    span.set_attr("tool_name", tool_name)
        except Exception:  # a hostile __getattr__ must not break the traced call
            pass

    return on_begin


class _OwnTrace:
    """An op called outside any trajectory: a trajectory whose root span is the op's own
    span (verl starts a new trace for it). Opens a trajectory, lets the op record its span
    inside, then makes that span the root before the trajectory is handed over."""

    __slots__ = ("attr", "traj")

    def __init__(self, name: str) -> None:
        style: dict[str, Any] = {STYLE_KEY: "verl-op"}
        self.attr = trace_attr(name=name, **style)
        self.traj: Any = None

    def __enter__(self) -> None:
        self.traj = self.attr.__enter__()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        traj = self.traj
        if traj is not None and traj.spans:
            traj.make_root(traj.spans[0])  # the first span opened inside: the op itself
        self.attr.__exit__(exc_type, exc, tb)
