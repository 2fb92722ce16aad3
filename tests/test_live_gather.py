"""The live numbers' way from rollout workers to a trainer's logger (tracer/live_gather.py),
without Ray: the partials are the real tracer's (``tracer.live.partial`` of traced
trajectories, the workers told apart by ``worker_id``), the driver's book merges them with
``tracer.live.merge`` and is checked against ``tracer.live.metrics`` of all of them. Through
real Ray processes and verl's own ``Tracking``: tests/test_verl_metrics.py (verl's venv)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer import RolloutTraceConfig, live_gather, rollout_trace_attr, rollout_trace_op
from tracer.live_gather import Gatherer, Publisher, StepBook

PER_STEP = 4  # trajectories a step per worker


class Loop:
    """verl's shape: an agent loop's ops under rollout_trace_attr (the drop-in API)."""

    @rollout_trace_op
    async def generate(self, prompt: str) -> str:
        return f"the answer to {prompt} is 4"

    @rollout_trace_op
    async def compute_score(self, answer: str, hacked: bool) -> dict[str, Any]:
        return {"score": 1.0, "acc": 0 if hacked else 1}


async def _step(step: int, hacked: bool, first: int = 0) -> None:
    loop = Loop()
    for i in range(first, first + PER_STEP):
        with rollout_trace_attr(sample_index=i, step=step, rollout_n=0, name="agent_loop"):
            await loop.compute_score(await loop.generate(f"2 + 2 ({i})"), hacked and i % 2 == 0)


def _worker(worker: str, steps: range, hacked: bool) -> dict[int, dict[str, Any]]:
    """One rollout worker's partials of ``steps`` (history=False, as the publisher sends)."""
    RolloutTraceConfig.init("live-gather", "e1", "memory", False, None, worker_id=worker,
                            raise_internal_errors=True)  # fmt: skip
    try:
        for step in steps:
            asyncio.run(_step(step, hacked and step >= 3))
        return {s: tracer.live.partial(s, history=False) for s in steps}
    finally:
        RolloutTraceConfig.reset()


@pytest.fixture(scope="module")
def parts() -> dict[str, dict[int, dict[str, Any]]]:
    return {"w1": _worker("host:1", range(1, 6), False), "w2": _worker("host:2", range(1, 6), True)}


def _halves(part: dict[str, Any]) -> list[dict[str, Any]]:
    rows = part["rows"]
    return [{**part, "rows": rows[:1]}, {**part, "rows": rows[1:]}]


def _live_only(numbers: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in numbers.items() if not k.startswith("tracer/live_")}


def test_the_driver_logs_the_merged_numbers_of_every_worker(parts: Any) -> None:
    book = StepBook()
    assert book.for_log(0) == {}  # nothing from any worker yet: verl's metrics alone
    for step in (1, 2, 3):
        # each worker's step in two pieces, and the first piece sent again (a resend after
        # a failed call): a trajectory is counted once
        pieces = [(step, w, p) for w in ("w1", "w2") for p in _halves(parts[w][step])]
        book.receive([*pieces, pieces[0]])
        book.refresh()
        logged = book.for_log(step)
        everything = [parts[w][s] for w in ("w1", "w2") for s in range(1, step + 1)]
        expected = tracer.live.metrics(tracer.live.merge(everything))
        assert _live_only(logged) == pytest.approx(_live_only(expected))
        assert logged["tracer/live_step_trajectories"] == 2 * PER_STEP
        assert logged["tracer/live_workers"] == 2
        assert logged["tracer/live_late_trajectories"] == 0
        assert {"patterns/unearned_reward_share", "timing/generate_share",
                "tracer/stuck_trajectories"} <= logged.keys()  # fmt: skip


def test_what_arrives_after_its_step_was_logged_is_counted(
    parts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    book = StepBook()
    for step in (1, 2, 3):
        book.receive([(step, w, parts[w][step]) for w in ("w1", "w2")])
    book.receive([(4, "w1", parts["w1"][4])])
    book.refresh()
    logged = book.for_log(4)  # verl logs step 4 before w2's part of it arrived
    assert logged["tracer/live_step_trajectories"] == PER_STEP
    assert logged["tracer/live_workers"] == 1
    with caplog.at_level(logging.WARNING, logger="tracer.verl"):
        book.receive([(4, "w2", parts["w2"][4]), (5, "w1", parts["w1"][5]),
                      (5, "w2", parts["w2"][5])])  # fmt: skip
        book.refresh()
    after = book.for_log(5)
    # step 4's trajectories: those in its logged numbers plus the late ones are all of them
    assert logged["tracer/live_step_trajectories"] + after["tracer/live_late_trajectories"] \
        == 2 * PER_STEP  # fmt: skip
    assert after["tracer/live_step_trajectories"] == 2 * PER_STEP
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout-tracer: the trainer logged step 4 before all its trajectories reached the "
        f"driver ({PER_STEP} late so far); the late ones are counted in "
        "tracer/live_late_trajectories, not in step 4's numbers (the trace store has them all)"]
    # a step older than every step the driver keeps is counted too, never dropped silently
    small = StepBook(keep_steps=2)
    small.receive([(s, "w1", parts["w1"][s]) for s in (3, 4)])
    small.receive([(1, "w1", parts["w1"][1])])
    small.refresh()
    assert sorted(small.parts) == [3, 4]
    assert small.for_log(4)["tracer/live_late_trajectories"] == PER_STEP


def test_a_worker_sends_only_what_is_new() -> None:
    RolloutTraceConfig.init("live-gather", "e2", "memory", False, None, worker_id="host:3",
                            raise_internal_errors=True)  # fmt: skip
    try:
        publisher = Publisher("host:3")  # the real partial: tracer.live.partial(history=False)
        publisher.note_step(1)
        asyncio.run(_step(1, False))
        tracer.flush()  # processed: the publisher itself never waits for it
        first = publisher._pieces(1)
        assert len(first[1]["rows"]) == PER_STEP
        publisher._sent(first, 1)
        asyncio.run(_step(1, False, first=PER_STEP))
        tracer.flush()
        second = publisher._pieces(1)
        assert len(second[1]["rows"]) == PER_STEP  # only the new ones
        assert {r["trace_id"] for r in second[1]["rows"]}.isdisjoint(
            r["trace_id"] for r in first[1]["rows"])  # fmt: skip
        publisher.sent.clear()  # after a failed send: everything again
        assert len(publisher._pieces(1)[1]["rows"]) == 2 * PER_STEP
    finally:
        RolloutTraceConfig.reset()


def test_the_gatherer_holds_pieces_until_the_driver_has_them() -> None:
    async def scenario() -> None:
        g = Gatherer(keep_steps=3)
        epoch, version, pieces = await g.changes("", 0, wait_s=0.01)
        assert (version, pieces) == (0, [])
        await g.put("w1", {1: {"rows": [1]}, 2: {"rows": [2]}})
        epoch, version, pieces = await g.changes(epoch, 0, wait_s=5)  # answers at once
        assert [p[:2] for p in pieces] == [(1, "w1"), (2, "w1")]
        await g.put("w2", {2: {"rows": [3]}})
        _, version, pieces = await g.changes(epoch, version, wait_s=5)
        assert [p[:2] for p in pieces] == [(2, "w2")]  # what the driver had is let go
        # a driver that does not know this gatherer (it was started again) gets all it holds
        assert len((await g.changes("other", version, wait_s=0.01))[2]) == 1
        for step in (3, 4, 5):  # a driver that stopped asking: only the newest steps kept
            await g.put("w1", {step: {"rows": [step]}})
        assert [p[0] for p in (await g.changes("other", 0, wait_s=0.01))[2]] == [3, 4, 5]
        waiter = asyncio.create_task(g.changes(g.epoch, g.version, wait_s=30))
        await asyncio.sleep(0.05)
        await g.put("w1", {6: {"rows": [6]}})  # the waiting driver is answered
        assert [p[0] for p in (await asyncio.wait_for(waiter, 10))[2]] == [6]

    asyncio.run(scenario())


def test_the_verl_page_says_what_the_code_does() -> None:
    page = (Path(__file__).parents[1] / "docs" / "verl.md").read_text()
    section = page[page.index("## Metrics in your tracker"):page.index("## A tracer never")]
    text = " ".join(section.split())
    assert live_gather.PUSH_INTERVAL_S == 0.5 and "every 0.5 s" in text
    assert live_gather.PUSH_STEPS == 4 and "four newest steps" in text
    assert live_gather.POLL_S == 0.5 and "at most twice a second" in text
    assert live_gather.RETRY_S == 5 and "starts it again 5 s later" in text
    assert f"`{live_gather.ACTOR_PREFIX}<job id>`, namespace `{live_gather.NAMESPACE}`" in text
