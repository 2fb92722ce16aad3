"""Background pipeline: hot-path buffer -> processing thread -> one export worker per backend.

    submit() ──> bounded deque ──> [processor thread: sampling check, token2text, truncation,
                                    redaction, TrajectoryRecord, JSON line per record]
                                        ├──> spool file ──> [export worker "mlflow"]
                                        └──> spool file ──> [export worker "jsonl"]

``submit`` never waits on a backend. When the buffer is full (count or bytes) the trajectory
overflows to the spool: the rollout's own thread builds its record and writes it there (slower
for that one call, nothing lost); only when that fails too is it dropped, and counted. Each
backend has its own thread and bounded queue, so a slow or failing backend never delays another
(tracer/export_worker.py); what the processing thread does to a batch is in
tracer/processing.py, the end of shutdown per backend in tracer/worker_shutdown.py. Threads start
lazily and restart in a forked child; every loop iteration is guarded, so an unexpected error
is counted and the loop goes on.

Counters reconcile, per backend, at any quiescent point::

    submitted == exported + pending + dropped
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracer.backends.base import Exporter, as_exporter
from tracer.errors import InternalErrors, log_every, say_at_shutdown
from tracer.export_worker import ExportWorker, wait_all
from tracer.keep import KeepRules
from tracer.live.steps import LiveSteps
from tracer.processing import Processing
from tracer.redact import Redactor
from tracer.spool import BackendSpool
from tracer.spool_folders import default_spool_dir
from tracer.worker_shutdown import stop_workers

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.sampling import Sampler
    from tracer.trajectory import Trajectory

log = logging.getLogger("tracer")

# Drop reasons that are decisions, not losses (flush() still returns True)
NOT_LOSSES = ("evicted_by_sampling", "not_kept")


class Pipeline(Processing):
    def __init__(
        self,
        config: TraceConfig,
        sampler: Sampler,
        exporter_factories: list[Callable[[], Exporter]],
        tokenizer: Callable[[], Any],
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.factories = exporter_factories
        self.tokenizer = tokenizer
        self.errors = InternalErrors(config.raise_internal_errors)
        self.redactor = (
            Redactor(config.redact_patterns, config.redact_callback) if config.redact else None
        )
        self._init_state()
        self.workers = [self._worker(f()) for f in exporter_factories]
        self.keep = self._keep_rules()
        self._forked = False
        ref = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := ref()) and m())

    def _worker(self, exporter: Exporter) -> ExportWorker:
        spool = None
        exporter = as_exporter(exporter)
        if self.config.spool and exporter.spoolable:
            name = exporter.name
            try:
                spool = BackendSpool(
                    self.config.spool_dir or default_spool_dir(),
                    name,
                    exporter.spool_key,
                    self.config,
                    self.config.max_spool_bytes,
                )
            except OSError as exc:  # the folder cannot be made: export from memory
                log.warning("rollout-tracer: no spool for %s (%s); exporting from memory only",
                            name, exc)
        return ExportWorker(exporter, self.config, self.errors, spool)

    def _init_state(self) -> None:
        # the bounds, read on every submit
        self._max_trajectories = self.config.max_buffer_trajectories
        self._max_bytes = self.config.max_buffer_bytes
        self._batch_size = self.config.export_batch_size
        self.buffer: collections.deque[tuple[int, Trajectory]] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.buffered_bytes = 0
        self.submitted = 0  # every trajectory handed to submit; also its sequence number
        # token -> (lowest seq, count, oldest end time in ns): batches being processed now
        self.in_process: dict[int, tuple[int, int, int]] = {}
        self._tokens = itertools.count()
        self.dropped: collections.Counter[str] = collections.Counter()  # before any worker
        self.overflowed = 0
        self.candidates_inline = 0  # tail candidates processed on the rollout's thread
        self.loop_errors = 0
        self.hot_ns = 0  # the rollout's time inside tracer code, over processed trajectories
        self.hot_trajectories = 0
        self.processor: threading.Thread | None = None
        self.closed = False
        self._lost_at_last_flush = 0
        self._end_steps: list[tuple[Any, bool | None]] = []  # tracer.end_step requests
        # the live per-step analysis (tracer/live/): fed by the processing thread
        self.live = LiveSteps(self.config.live_steps) if self.config.live_steps else None

    def _after_fork(self) -> None:
        # The parent exports what was buffered before the fork; the child starts empty, with
        # fresh locks, fresh exporters (connections must not be shared) and no threads yet.
        self._init_state()
        self.workers = []
        self._forked = True
        self.keep = self._keep_rules()  # the parent decides what it held; the child starts empty

    def _keep_rules(self) -> KeepRules | None:
        c = self.config
        if not c.keep_on:
            return None
        # what the rules hold waiting for a decision: the buffer's other half
        return KeepRules(c.keep, c.keep_max_per_step, c.keep_group_size, c.keep_predicate,
                         c.sampling_seed, max_held=max(1, c.max_buffer_trajectories // 2),
                         max_held_bytes=max(1, c.max_buffer_bytes // 2))  # fmt: skip

    # hot path -------------------------------------------------------------------------
    def submit(self, traj: Trajectory) -> None:
        """Hand a finished trajectory to the buffer (the rollout's thread; never raises:
        ``Tracer.start`` binds it as ``Tracer.submit``, one Python call per trajectory)."""
        try:
            with self.lock:
                self.submitted += 1
                seq = self.submitted
                if self.closed:
                    self._drop_before_workers(1, "after_shutdown")
                    return
                keep = self.keep
                if keep is not None and not self._room_for_candidate(keep, traj):
                    # no room to wait in the buffer: its keep rules decide now, on this thread
                    # (a rule match is never dropped unseen; the rules bound what they hold)
                    token = next(self._tokens)
                    self.in_process[token] = (seq, 1, traj.end_ns)
                    self.candidates_inline += 1
                    n = 0
                else:
                    buffer = self.buffer
                    n = len(buffer)
                    nbytes = traj.nbytes
                    fits = self.buffered_bytes + nbytes <= self._max_bytes
                    if n < self._max_trajectories and fits:
                        buffer.append((seq, traj))
                        self.buffered_bytes += nbytes
                        if self.processor is None:
                            self._start()
                        if n + 1 == self._batch_size:  # once per batch, not on every later one
                            self.wake.set()
                        return
                    if not any(w.spool is not None for w in self.workers):
                        self._drop_before_workers(1, "buffer_full")
                        return
                    token = next(self._tokens)
                    self.in_process[token] = (seq, 1, traj.end_ns)
                    self.overflowed += 1
                    n = self.overflowed
            self.wake.set()
            if n and log_every(n):
                log.warning(
                    "rollout-tracer: trace buffer full (%d trajectories, %d bytes): finished "
                    "trajectories are written to the spool on the rollout's thread (slower); "
                    "raise max_buffer_trajectories/max_buffer_bytes or sample less [%d so far]",
                    self.config.max_buffer_trajectories, self.config.max_buffer_bytes,
                    n)  # fmt: skip
            self._process_guarded([(seq, traj)], token)
        except Exception as exc:  # never let the tracer break the rollout
            self.errors.report("submitting a trajectory", exc)  # raises only in tests

    def _room_for_candidate(self, keep: KeepRules, traj: Trajectory) -> bool:
        """Tail candidates (in the buffer and held by the keep rules) use at most half of the
        buffer's bounds, so they never crowd out head-sampled trajectories; one that finds no
        room is processed at once on the submitting thread (caller holds ``lock``)."""
        c = self.config
        if (
            len(self.buffer) + keep.held < c.max_buffer_trajectories // 2
            and self.buffered_bytes + keep.held_bytes + traj.nbytes <= c.max_buffer_bytes // 2
        ):
            return True
        return self.sampler.holds(traj.step, traj.sample_index, traj.validate)

    def _drop_before_workers(self, n: int, reason: str) -> None:
        """Count trajectories lost before reaching any backend (caller holds ``lock``)."""
        self.dropped[reason] += n
        if reason not in NOT_LOSSES:
            total = sum(v for k, v in self.dropped.items() if k not in NOT_LOSSES)
            if log_every(total):
                log.warning("rollout-tracer: %d trajectories dropped (%s); %d so far",
                            n, reason, total)

    # background -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._forked and not self.workers:
            self.workers = [self._worker(f()) for f in self.factories]
        for w in self.workers:
            w.start()
        processor = threading.Thread(target=self._process_loop, name="rollout-tracer",
                                     daemon=True)  # fmt: skip
        processor.start()  # may raise (no thread left): the next submit tries again
        self.processor = processor

    def _process_loop(self) -> None:
        while True:
            try:
                self.wake.wait(self.config.flush_interval_s)
                self.wake.clear()
                self._drain()
                self._end_requested_steps()
                with self.lock:
                    if self.closed and not self.buffer:
                        return
            except Exception as exc:  # the loop goes on; what was taken is in _process
                with self.lock:
                    self.loop_errors += 1
                self.errors.report("processing trajectories", exc, background=True)
                time.sleep(0.05)

    def _drain(self) -> None:
        """Process what the buffer holds at this wake, a batch at a time: the first batch
        whatever its size, then more only while a whole batch waits. What arrives meanwhile
        waits for the next wake (a whole batch, ``flush_interval_s``, or a flush): taking it at
        once made a batch of a few trajectories after each full one (23 batches, 13 of them
        1-9 trajectories, for 750 trajectories at 75 a second), and each batch costs a spool
        file, an export call and a store transaction whatever its size."""
        first = True
        while True:
            with self.lock:
                if not self.buffer or (
                    not first and len(self.buffer) < self.config.export_batch_size
                ):
                    return
                first = False
                batch: list[tuple[int, Trajectory]] = []
                while self.buffer and len(batch) < self.config.export_batch_size:
                    seq, traj = self.buffer.popleft()
                    self.buffered_bytes -= traj.nbytes
                    batch.append((seq, traj))
                token = next(self._tokens)
                self.in_process[token] = (batch[0][0], len(batch),
                                          min(t.end_ns for _, t in batch))
            self._process_guarded(batch, token)

    # control --------------------------------------------------------------------------
    def _outstanding(self, target: int) -> bool:
        with self.lock:
            if self.buffer and self.buffer[0][0] <= target:
                return True
            return any(seq <= target for seq, _, _ in self.in_process.values())

    def _wait_processed(self, target: int, deadline: float) -> bool:
        self.wake.set()
        while self._outstanding(target):
            if time.monotonic() >= deadline or not self._processor_alive():
                return False
            time.sleep(0.005)
            self.wake.set()
        return True

    def processed(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far has been processed (built, analysed and
        handed to the export workers, not yet stored): what the live analysis needs."""
        with self.lock:
            target = self.submitted
            started = self.processor is not None
        return not started or self._wait_processed(target, time.monotonic() + timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything submitted so far is stored, probing a backend that is down
        until it answers or ``timeout_s`` passes. True only when nothing traced so far is
        still waiting and nothing was lost since the previous flush."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            target = self.submitted
            started = self.processor is not None
        ok = not started or self._wait_processed(target, deadline)
        if self.keep is not None:  # flush decides: every step held so far is finished
            self._hand_released(self.keep.finish_all())  # the caller's thread
        if started and ok:
            ok = wait_all(self.workers, target, deadline)
        lost = self._lost_total()
        if lost > self._lost_at_last_flush:
            ok = False
            self._lost_at_last_flush = lost
        self.errors.check()
        return ok

    def _lost_total(self) -> int:
        n = sum(v for k, v in self.dropped.items() if k not in NOT_LOSSES)
        return n + sum(sum(w.dropped.values()) for w in self.workers)

    def _processor_alive(self) -> bool:
        return self.processor is None or self.processor.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """Flush within ``timeout_s``, stop the threads, and say where anything left is."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.closing(deadline)
        try:
            ok = self.flush(timeout_s)
        finally:
            with self.lock:
                self.closed = True
            self.wake.set()
        if self.processor is not None:
            self.processor.join(max(0.0, deadline - time.monotonic()))
        with self.lock:  # the processor did not get to these in time
            while self.buffer:
                _seq, traj = self.buffer.popleft()
                self.buffered_bytes -= traj.nbytes
                self._drop_before_workers(1, "unexported_at_exit")
                ok = False
            # taken but not handed on yet (a slow redact callback, a hung disk): said here;
            # handed on later, each backend spools them with a line (BatchQueue.put_late)
            busy = sum(n for _, n, _ in self.in_process.values())
        if busy:
            ok = False
            then = ("the spool takes them if they are done before the process exits"
                    if any(w.spool is not None for w in self.workers) else "they are lost")
            say_at_shutdown(f"rollout-tracer: {busy} trajectories were still being processed "
                            f"when shutdown's {timeout_s:g} s ran out; they are not exported "
                            f"({then})")  # fmt: skip
        # tracer/worker_shutdown.py: stop, then say where the rest is; returns within
        # STOP_GRACE_S + ABORT_GRACE_S after the deadline, whatever the number of backends
        return stop_workers(self.workers, deadline, self.errors) and ok

    def _durability_lag_s(self) -> float:
        """Age of the oldest finished trajectory that is on neither the spool's disk nor a
        backend (in the buffer, being processed, or in a memory-only batch); 0 when none. Tail
        candidates the keep rules hold for their group's decision are not counted here
        (``tracer/keep/held``). Caller holds ``lock``."""
        oldest = [t.end_ns for _, t in itertools.islice(self.buffer, 1)]
        oldest += [born for _, _, born in self.in_process.values()]
        oldest += [b for w in self.workers if (b := w.oldest_in_memory_ns()) is not None]
        if not oldest:
            return 0.0
        return max(0.0, (time.time_ns() - min(oldest)) / 1e9)

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            pending = len(self.buffer) + sum(n for _, n, _ in self.in_process.values())
            if self.keep is not None:
                pending += self.keep.held
            m: dict[str, Any] = {
                "tracer/submitted": self.submitted,
                "tracer/queue_depth": len(self.buffer),
                "tracer/queue_bytes": self.buffered_bytes,
                "tracer/overflowed_to_spool": self.overflowed,
                "tracer/keep/candidates_processed_inline": self.candidates_inline,
                "tracer/dropped_buffer_full": self.dropped["buffer_full"],
                "tracer/evicted_by_sampling": self.dropped["evicted_by_sampling"],
                "tracer/process_errors": self.dropped["build_error"],
                "tracer/internal_errors": self.errors.total,
                "tracer/loop_errors": self.loop_errors,
                "tracer/processor_alive": int(self._processor_alive()),
                "tracer/hot_path_ms": self.hot_ns / 1e6,
                "tracer/hot_path_us_per_trajectory": (
                    self.hot_ns / 1e3 / self.hot_trajectories if self.hot_trajectories else 0.0),
                # age of the oldest finished trajectory on neither disk nor a backend
                "tracer/durability_lag_s": self._durability_lag_s(),
            }
            for reason, count in self.dropped.items():
                m[f"tracer/dropped/{reason}"] = count
            before_workers = sum(self.dropped.values())
        if self.keep is not None:
            m.update(self.keep.metrics())
        if self.live is not None:
            m.update(self.live.metrics())
        for w in self.workers:
            prefix = f"tracer/{w.name}/"
            wm = w.metrics(prefix)
            # Per backend: submitted == exported + pending + dropped at any quiescent point.
            wm[f"{prefix}pending"] += pending
            wm[f"{prefix}dropped"] = before_workers + wm[f"{prefix}failed"]
            m.update(wm)
        return m
