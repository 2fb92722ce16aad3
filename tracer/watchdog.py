"""The stuck-trajectory watchdog: reports, once and while it still runs, a trajectory open far
too long.

It watches every rollout, sampled or not. The hot path does one thing for it: ``trace_attr``
adds the trajectory to its tracer's set of open trajectories when it opens (one C call); a
rollout the sampler leaves out is not recorded, but its ``trace_attr`` (which holds its step,
sample and attributes) and its start time are put in a dict as it opens and taken out as it
closes. This module's thread looks at both every tick, on its own: it never touches the
rollout's threads. A trajectory that has ended (its end
timestamp, which ``trace_attr`` takes anyway, is set) leaves the set there, and its wall time
counts towards its step's typical one. One still open is stuck when it has been open longer
than ``stuck_after_s``, or longer than ``TYPICAL_FACTOR`` times its step's typical wall time
(the median of the step's ended trajectories, once ``MIN_TYPICAL`` have ended) and at least
``TYPICAL_FLOOR_S``. An ended trajectory stays referenced until the next tick (at most a
second), as it does in the pipeline's buffer. Each stuck trajectory is reported once: one log line
naming its sample and GRPO group (step, sample_index, rollout_n), its tags, the worker (host,
pid, the Ray actor it runs in, the ``RANK`` torchrun and accelerate set), its trace id and open
span (a tool call's name and arguments; an unsampled rollout has no trace and no spans), and
the counter ``tracer/stuck_trajectories``. The loop is guarded (an error is counted, logged
once, and the loop goes on) and restarts in a forked child.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import weakref
from typing import Any

from tracer.errors import log_every
from tracer.snapshot import plain

log = logging.getLogger("tracer")

TYPICAL_FACTOR = 50.0
TYPICAL_FLOOR_S = 2.0
MIN_TYPICAL = 5  # finished trajectories of a step before its typical time counts
_WALLS_PER_STEP = 256
_STEPS_KEPT = 16
_ENDED_KEPT = 4096  # wall times of ended trajectories not yet read by a tick (bounded)


class OpenTrajectories(set):  # type: ignore[type-arg]
    """The traced trajectories still open. ``trace_attr`` adds one as it opens and calls
    ``ended`` as it closes: the trajectory leaves at once (a finished trajectory and its
    payload are never held here), and only its step and wall time wait, in a bounded deque,
    for the watchdog's next tick (its step's typical time)."""

    def __init__(self) -> None:
        super().__init__()
        self.walls: collections.deque[tuple[Any, bool, float]] = collections.deque(
            maxlen=_ENDED_KEPT
        )

        # rollouts the sampler left out, open now: id(trace_attr) -> trace_attr (its kwargs
        # and _start_ns are what a report names)
        self.unsampled: dict[int, Any] = {}

    def ended(self, traj: Any) -> None:
        self.discard(traj)
        self.walls.append((traj.step, bool(traj.validate), (traj.end_ns - traj.start_ns) / 1e9))

    def watch(self, attr: Any) -> None:
        self.unsampled[id(attr)] = attr

    def unwatch(self, attr: Any) -> None:
        self.unsampled.pop(id(attr), None)


def worker_description() -> str:
    """``host=h pid=1 ray_actor=Name rank=0``: where a rollout runs. The Ray actor only when Ray
    is already imported and this process is one of its actors; the rank from ``RANK``."""
    out = f"host={socket.gethostname()} pid={os.getpid()}"
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                actor = ctx.get_actor_name() or ctx.get_actor_id()
                if actor:
                    out += f" ray_actor={actor}"
        except Exception:  # an older Ray, a driver: the host and pid say enough
            pass
    rank = os.environ.get("RANK")
    return out if rank is None else f"{out} rank={rank}"
_ARGS_CHARS = 300



def describe_span(span: Any, now_ns: int) -> str:
    """``tool python arguments={...} (open 12.0 s)``: what a trajectory is waiting on."""
    open_s = (now_ns - span.start_ns) / 1e9
    inputs = plain(span.inputs)
    if span.kind == "tool" and isinstance(inputs, dict):
        name = inputs.get("name", inputs.get("tool_name", span.name))
        args = inputs.get("arguments", {k: v for k, v in inputs.items() if k != "name"})
        text = json.dumps(args, ensure_ascii=False, default=str, sort_keys=True)
        if len(text) > _ARGS_CHARS:
            text = text[: _ARGS_CHARS - 1] + "…"
        return f"tool {name} arguments={text} (open {open_s:.1f} s)"
    return f"{span.kind} {span.name} (open {open_s:.1f} s)"


class Watchdog:
    """``Watchdog(config, open_trajectories).start()``; ``stop()``; ``metrics()``."""

    def __init__(self, config: Any, open_trajectories: OpenTrajectories) -> None:
        self.limit_s = float(config.stuck_after_s)
        self.open = open_trajectories  # the tracer's; the hot path adds and removes
        self.interval_s = min(1.0, max(0.02, self.limit_s / 10))
        self._init_state()
        ref = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := ref()) and m())

    def _init_state(self) -> None:
        self.reported: set[int] = set()  # id() of the open trajectories reported
        self.walls: collections.OrderedDict[Any, collections.deque[float]] = (
            collections.OrderedDict()
        )
        self.stuck_total = 0
        self.stuck_open = 0
        self.errors = 0
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _after_fork(self) -> None:
        # the parent's threads do not exist here; its open trajectories are not this process's
        running = self.thread is not None and not self._stop.is_set()
        self.open.clear()
        self.open.walls.clear()
        self.open.unsampled.clear()
        self._init_state()
        if running:
            self.start()

    def start(self) -> Watchdog:
        thread = threading.Thread(target=self._loop, name="rollout-tracer-watchdog", daemon=True)
        thread.start()
        self.thread = thread
        return self

    def stop(self) -> None:
        self._stop.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        self.open.clear()  # nothing reads it any more: hold no trajectory
        self.open.unsampled.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick(time.time_ns())
            except Exception as exc:  # a background loop cannot die
                self.errors += 1
                if log_every(self.errors):
                    log.warning(
                        "rollout-tracer: the stuck-trajectory watchdog failed (%s: %s); "
                        "it goes on [%d so far]",
                        type(exc).__name__,
                        exc,
                        self.errors,
                    )

    def typical_s(self, step: Any, validate: Any) -> float | None:
        walls = self.walls.get((step, bool(validate)))
        if walls is None or len(walls) < MIN_TYPICAL:
            return None
        return statistics.median(walls)

    def _finished(self, step: Any, validate: bool, wall_s: float) -> None:
        key = (step, validate)
        walls = self.walls.get(key)
        if walls is None:
            walls = self.walls[key] = collections.deque(maxlen=_WALLS_PER_STEP)
            while len(self.walls) > _STEPS_KEPT:
                self.walls.popitem(last=False)
        walls.append(wall_s)

    def tick(self, now_ns: int) -> None:
        """One look at the open trajectories (the watchdog's thread; tests call it too)."""
        ended = self.open.walls
        for _ in range(len(ended)):  # ended since the last tick: their wall times are typical
            self._finished(*ended.popleft())
        current: dict[int, tuple[int, Any, Any]] = {}
        for traj in list(self.open):  # list(set): one C call, atomic under the GIL
            if not traj.end_ns:  # ended but not yet out of the set (trace_attr's exit)
                current[id(traj)] = (traj.start_ns, traj.step, traj.validate)
        for key, attr in list(self.open.unsampled.items()):  # one C call too
            start_ns = attr._start_ns
            if start_ns:  # 0: closed since
                current[key] = (start_ns, attr.kwargs[0], attr.kwargs[3])
        self.reported &= current.keys()
        stuck = 0
        for key, (start_ns, step, validate) in current.items():
            age_s = (now_ns - start_ns) / 1e9
            limit = self.limit_s
            typical = self.typical_s(step, validate)
            if typical is not None:
                limit = min(limit, max(TYPICAL_FACTOR * typical, TYPICAL_FLOOR_S))
            if age_s <= limit:
                continue
            stuck += 1
            if key not in self.reported:
                self.reported.add(key)
                self.stuck_total += 1
                self._report(key, age_s, typical, now_ns)
        self.stuck_open = stuck

    def _report(self, key: int, age_s: float, typical: float | None, now_ns: int) -> None:
        traj = next((t for t in list(self.open) if id(t) == key), None)
        if traj is not None:
            spans = [s for s in list(traj.spans) if not s.end_ns]
            what = describe_span(spans[-1], now_ns) if spans else "no span open"
            step, sample, n, validate, attempt = (traj.step, traj.sample_index, traj.rollout_n,
                                                  traj.validate, traj.attempt)  # fmt: skip
            attributes, trace = traj.attributes, f"trace_id={traj.trace_id}"
        else:
            attr = self.open.unsampled.get(key)
            if attr is None:  # closed just now
                return
            step, sample, n, validate, _, _, _, attributes, attempt = attr.kwargs
            trace, what = "not sampled (no trace)", "not recorded"
        why = f"stuck_after_s={self.limit_s:g}"
        if typical is not None:
            why += f"; its step's typical {typical:.2f} s"
        attrs = "".join(f" {k}={v!r}" for k, v in (attributes or {}).items())
        log.warning(
            "rollout-tracer: trajectory still open after %.1f s (%s): step=%s sample_index=%s "
            "rollout_n=%s (group: step %s, sample %s) validate=%s attempt=%s%s; worker: %s; "
            "%s; open span: %s",
            age_s, why, step, sample, n, step, sample, validate, attempt or 0, attrs,
            worker_description(), trace, what)  # fmt: skip

    def metrics(self) -> dict[str, Any]:
        return {
            "tracer/stuck_trajectories": self.stuck_total,  # reported, each once
            "tracer/stuck_open": self.stuck_open,  # open and stuck at the last tick
            "tracer/watchdog_alive": int(self.thread is not None and self.thread.is_alive()),
            "tracer/watchdog_errors": self.errors,
        }
