"""Keep rules (tail sampling): decide, when a trajectory or its GRPO group ends, whether a
trajectory that head sampling left out is worth storing anyway.

With ``TraceConfig.keep`` set, every trajectory is recorded (see ``Tracer.admit``); the
pipeline builds its record off the hot path and hands it here with ``head=True`` when head
sampling chose it (exported at once, tagged ``kept_by=sampled[,...]``) or ``head=False`` for a
tail candidate, which is held until every rule that could keep it has decided. The rules:

``errors``                the trajectory raised (its root span is ERROR).
``truncated``             a generate call ended with ``finish_reason == "length"``.
``predicate``             ``TraceConfig.keep_predicate(record)`` returned true.
``tool_errors``           some trajectory of its group (same step, sample_index, validate) had
                          a tool call that raised or returned an ``error``: the whole group.
``zero_variance_groups``  every trajectory of its group (at least two) has the same reward.
``extreme_rewards``       the lowest or the highest reward of its (step, validate), ties broken
                          by a seeded hash of (sample_index, rollout_n).

When decisions happen. Per-trajectory rules decide at once. A group decides when it has
``keep_group_size`` members (the rollout's ``n``), as soon as the outcome is known (a tool error
keeps it, two different rewards rule out zero variance), or when its step is finished.
Extreme rewards are a running min/max per step with replacement: at most one candidate for
each end is held, and a newcomer that beats it takes its place (the old one is released to
its other rules or dropped). A step is finished by ``tracer.end_step(step)``, by ``flush()``/
``shutdown()``, or when more than ``OPEN_STEPS`` (step, validate) keys are open (the oldest).
A trajectory of a step that was already finished opens it afresh (a straggler can then be
kept as a second min/max): call ``end_step`` after the step's last trajectory for exactness.

Determinism. Every choice depends on the data, never on arrival order: min/max use a total
order (reward, hash), group outcomes are order-free, and ``keep_max_per_step`` keeps the best
candidates of a step by (position in ``keep`` of the best rule that kept them, hash of the
sample, hash of rollout_n) -- a bottom-k with replacement, released when the step finishes --
so groups stay whole except at the cut. Without a cap, kept candidates leave as they are
decided.

Bounded, and rules first. Held candidates count against the pipeline's buffer: together with
the candidates queued there they use at most half of ``max_buffer_trajectories`` /
``max_buffer_bytes``. A candidate that finds no room to queue is processed at once on the
submitting thread, so every rule sees every candidate and a match is never dropped unseen.
When what the rules hold passes ``max_held`` / ``max_held_bytes``, the oldest open step is
finished early (``tracer/keep/steps_finished_early``): its groups and extremes decide with
what has arrived, and a later straggler of that step opens it afresh. Finishing early can keep
more than a complete step would (a group judged on some of its members), never less of what
matched.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tracer.errors import log_every
from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")

OPEN_STEPS = 4  # (step, validate) keys decided at once before the oldest is finished
GROUP_RULES = ("tool_errors", "zero_variance_groups")


def _hash(seed: int, *parts: Any) -> int:
    key = "|".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def has_tool_error(record: TrajectoryRecord) -> bool:
    for span in record.spans:
        if span.kind != "tool":
            continue
        if span.status == "ERROR":
            return True
        out = span.outputs
        if isinstance(out, dict) and out.get("error") not in (None, ""):
            return True
    return False


def is_truncated(record: TrajectoryRecord) -> bool:
    return any(
        s.kind == "generate" and s.attributes.get("finish_reason") == "length"
        for s in record.spans
    )


class _Entry:
    """A tail candidate held until its rules decide."""

    __slots__ = ("done", "nbytes", "rank", "record", "rules", "seq", "waits")

    def __init__(self, seq: int, record: TrajectoryRecord, nbytes: int, tiebreak: int) -> None:
        self.seq = seq
        self.record = record
        self.nbytes = nbytes
        self.rules: set[str] = set()  # rules that keep it
        self.waits: set[str] = set()  # "observe", "group", "min", "max": still undecided
        self.rank = (0, tiebreak)
        self.done = False  # emitted, pooled or dropped


class _Group:
    __slots__ = ("decided", "first_reward", "members", "seen", "tool_error", "varied")

    def __init__(self) -> None:
        self.members: list[_Entry] = []
        self.seen = 0
        self.first_reward: float | None = None
        self.varied = False
        self.tool_error = False
        self.decided = False


class _Step:
    __slots__ = ("groups", "max", "min", "pool")

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        # current extreme: (order key, the entry holding it, or None when head-sampled)
        self.max: tuple[tuple[float, int], _Entry | None] | None = None
        self.min: tuple[tuple[float, int], _Entry | None] | None = None
        self.pool: list[_Entry] = []  # kept, waiting for the step's end (keep_max_per_step)


Released = tuple[list[tuple[int, TrajectoryRecord]], int]  # (to export, dropped as not_kept)


class KeepRules:
    """Thread-safe; used by the pipeline's processing thread (never on the hot path)."""

    def __init__(
        self,
        rules: list[str],
        max_per_step: int | None = None,
        group_size: int | None = None,
        predicate: Callable[[TrajectoryRecord], Any] | None = None,
        seed: int = 0,
        max_held: int | None = None,
        max_held_bytes: int | None = None,
    ) -> None:
        self.rules = list(rules)
        if predicate is not None and "predicate" not in self.rules:
            self.rules.append("predicate")
        self.priority = {rule: i for i, rule in enumerate(self.rules)}
        self.max_per_step = max_per_step
        self.group_size = group_size
        self.predicate = predicate
        self.seed = seed
        self.grouped = any(r in self.rules for r in GROUP_RULES)
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[Any, bool], _Step] = OrderedDict()
        self.held = 0  # candidates held (waiting or pooled): count against the buffer
        self.held_bytes = 0
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.finished_early = 0  # steps finished before their end to stay within max_held
        self.kept: dict[str, int] = {r: 0 for r in self.rules}
        self.candidates = 0
        self.capped = 0
        self.predicate_errors = 0

    # ------------------------------------------------------------------------------ input
    def observe(self, seq: int, record: TrajectoryRecord, nbytes: int, head: bool) -> Released:
        """A finished trajectory's record. Returns what to export now and how many were
        dropped (this one or earlier candidates it displaced)."""
        out: list[tuple[int, TrajectoryRecord]] = []
        dropped = [0]
        matched = self._own_rules(record)
        key = (record.step, bool(record.validate))
        sample = str(record.sample_index)
        with self._lock:
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = _Step()
                while len(self._steps) > OPEN_STEPS:
                    old_key = next(iter(self._steps))
                    self._finish(old_key, out, dropped)
            entry = None
            if not head:
                self.candidates += 1
                tiebreak = _hash(self.seed, record.step, record.validate, sample,
                                 record.rollout_n)  # fmt: skip
                entry = _Entry(seq, record, nbytes, tiebreak)
                entry.rules |= matched
                entry.waits.add("observe")  # settled only after every rule has seen it
                self.held += 1
                self.held_bytes += nbytes
            if self.grouped:
                self._group_observe(step, sample, record, entry, matched, out, dropped)
            if "extreme_rewards" in self.rules and record.reward is not None:
                self._extremes(step, record, entry, out, dropped)
            if entry is not None:
                entry.waits.discard("observe")
                self._settle(step, entry, out, dropped)
            while self._over_bound() and self._steps:  # oldest first, this one last
                self.finished_early += 1
                self._finish(next(iter(self._steps)), out, dropped)
        if head:
            tags = ["sampled", *sorted(matched, key=self.priority.__getitem__)]
            record.attributes["kept_by"] = ",".join(tags)
            out.append((seq, record))
        return out, dropped[0]

    def _over_bound(self) -> bool:
        return (self.max_held is not None and self.held > self.max_held) or (
            self.max_held_bytes is not None and self.held_bytes > self.max_held_bytes)

    def _own_rules(self, record: TrajectoryRecord) -> set[str]:
        rules = set()
        if "errors" in self.rules and record.status == "ERROR":
            rules.add("errors")
        if "truncated" in self.rules and is_truncated(record):
            rules.add("truncated")
        if self.predicate is not None:
            try:
                if self.predicate(record):
                    rules.add("predicate")
            except Exception as exc:  # user code: counted and logged, never fatal
                with self._lock:
                    self.predicate_errors += 1
                    n = self.predicate_errors
                if log_every(n):
                    log.warning("rollout-tracer: keep_predicate raised %s: %s [%d so far]",
                                type(exc).__name__, exc, n)  # fmt: skip
        return rules

    def _group_observe(
        self,
        step: _Step,
        sample: str,
        record: TrajectoryRecord,
        entry: _Entry | None,
        matched: set[str],
        out: list[tuple[int, TrajectoryRecord]],
        dropped: list[int],
    ) -> None:
        group = step.groups.get(sample)
        if group is None:
            group = step.groups[sample] = _Group()
        group.seen += 1
        if "tool_errors" in self.rules and not group.tool_error and has_tool_error(record):
            group.tool_error = True
            for member in group.members:
                member.rules.add("tool_errors")
        if group.seen == 1:
            group.first_reward = record.reward
        elif record.reward != group.first_reward:
            group.varied = True
        if group.tool_error:
            matched.add("tool_errors")  # a head-sampled member's tag too
        if entry is not None:
            entry.rules |= matched & {"tool_errors"}
            if not group.decided:
                entry.waits.add("group")
                group.members.append(entry)
            elif "zero_variance_groups" in self.rules and not group.varied and group.seen > 1:
                entry.rules.add("zero_variance_groups")
        settled = (
            ("tool_errors" not in self.rules or group.tool_error)
            and ("zero_variance_groups" not in self.rules or group.varied)
        )
        if not group.decided and (
            settled or (self.group_size is not None and group.seen >= self.group_size)
        ):
            self._decide_group(step, group, out, dropped)

    def _decide_group(
        self, step: _Step, group: _Group, out: list[tuple[int, TrajectoryRecord]],
        dropped: list[int],
    ) -> None:
        group.decided = True
        collapsed = ("zero_variance_groups" in self.rules and not group.varied
                     and group.seen > 1)  # fmt: skip
        members, group.members = group.members, []
        for member in members:
            if collapsed:
                member.rules.add("zero_variance_groups")
            member.waits.discard("group")
            self._settle(step, member, out, dropped)

    def _extremes(
        self,
        step: _Step,
        record: TrajectoryRecord,
        entry: _Entry | None,
        out: list[tuple[int, TrajectoryRecord]],
        dropped: list[int],
    ) -> None:
        reward = float(record.reward)  # type: ignore[arg-type]
        tiebreak = _hash(self.seed, "x", record.sample_index, record.rollout_n)
        for end, order in (("max", (reward, tiebreak)), ("min", (-reward, tiebreak))):
            current = getattr(step, end)
            if current is not None and current[0] >= order:
                continue
            setattr(step, end, (order, entry))
            if entry is not None:
                entry.waits.add(end)
            if current is not None and current[1] is not None:
                loser = current[1]
                loser.waits.discard(end)
                self._settle(step, loser, out, dropped)

    # ---------------------------------------------------------------------------- output
    def _settle(
        self,
        step: _Step,
        entry: _Entry,
        out: list[tuple[int, TrajectoryRecord]],
        dropped: list[int],
    ) -> None:
        """An entry with nothing left to wait for is kept (now or at the step's end, when
        capped) or dropped."""
        if entry.waits or entry.done:
            return
        entry.done = True
        if not entry.rules:
            self._release(entry)
            dropped[0] += 1
            return
        best = min(self.priority[r] for r in entry.rules)
        entry.rank = (best, entry.rank[1])
        if self.max_per_step is None:
            self._emit(entry, out)
            return
        step.pool.append(entry)
        if len(step.pool) > self.max_per_step:
            worst = max(step.pool, key=lambda e: e.rank)
            step.pool.remove(worst)
            self._release(worst)
            self.capped += 1
            dropped[0] += 1

    def _emit(self, entry: _Entry, out: list[tuple[int, TrajectoryRecord]]) -> None:
        rules = sorted(entry.rules, key=self.priority.__getitem__)
        for rule in rules:
            self.kept[rule] += 1
        entry.record.attributes["kept_by"] = ",".join(rules)
        self._release(entry)
        out.append((entry.seq, entry.record))

    def _release(self, entry: _Entry) -> None:
        self.held -= 1
        self.held_bytes -= entry.nbytes

    def _finish(
        self, key: tuple[Any, bool], out: list[tuple[int, TrajectoryRecord]], dropped: list[int]
    ) -> None:
        step = self._steps.pop(key)
        extremes = [e for e in (step.max, step.min) if e is not None and e[1] is not None]
        step.max = step.min = None
        for _order, entry in extremes:
            assert entry is not None
            entry.rules.add("extreme_rewards")
            entry.waits -= {"max", "min"}
        for _order, entry in extremes:
            assert entry is not None
            self._settle(step, entry, out, dropped)
        for group in step.groups.values():
            if not group.decided:
                self._decide_group(step, group, out, dropped)
        for end_entry in list(step.pool):
            self._emit(end_entry, out)
        step.pool.clear()

    def end_step(self, step: Any, validate: bool | None = None) -> Released:
        """Finish ``step`` (both validate keys when ``validate`` is None)."""
        out: list[tuple[int, TrajectoryRecord]] = []
        dropped = [0]
        with self._lock:
            for key in list(self._steps):
                if key[0] == step and (validate is None or key[1] == bool(validate)):
                    self._finish(key, out, dropped)
        return out, dropped[0]

    def finish_all(self) -> Released:
        out: list[tuple[int, TrajectoryRecord]] = []
        dropped = [0]
        with self._lock:
            for key in list(self._steps):
                self._finish(key, out, dropped)
        return out, dropped[0]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            m: dict[str, float] = {
                "tracer/keep/candidates": self.candidates,
                "tracer/keep/held": self.held,
                "tracer/keep/held_bytes": self.held_bytes,
                "tracer/keep/capped": self.capped,
                "tracer/keep/steps_finished_early": self.finished_early,
                "tracer/keep/predicate_errors": self.predicate_errors,
            }
            for rule, n in self.kept.items():
                m[f"tracer/keep/kept/{rule}"] = n
            return m
