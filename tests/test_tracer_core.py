"""Decorator paths, concurrency, failure isolation, config errors, verl compatibility.

These use the in-memory backend shipped in ``tracer.testing`` (the same pipeline as every
backend); what the MLflow store holds is covered in test_tracer_mlflow.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest

import tracer
from tracer.backends import register_backend
from tracer.backends.base import ExportResult
from tracer.record import TrajectoryRecord
from tracer.sampling import sample_hash
from tracer.testing import InMemoryExporter


def memory(**overrides: Any) -> InMemoryExporter:
    tracer.init({"backend": "memory", "raise_internal_errors": True, **overrides})
    return InMemoryExporter.latest()


def spans_by_name(record: TrajectoryRecord) -> dict[str, Any]:
    return {s.name: s for s in record.spans}


class Agent:
    def __init__(self) -> None:
        self.tokenizer = None

    @tracer.trace_op(kind="generate")
    def gen_sync(self, prompt: str, n: int = 1) -> str:
        return prompt * n

    @tracer.trace_op(kind="generate")
    async def gen_async(self, prompt: str) -> str:
        await asyncio.sleep(0)
        return prompt + "!"

    @tracer.trace_op(kind="parse")
    def gen_items(self, n: int):
        yield from range(n)
        return "done"

    @tracer.trace_op(kind="tool")
    async def agen_items(self, n: int):
        for i in range(n):
            await asyncio.sleep(0)
            yield i * 10


def test_sync_async_generator_and_async_generator_paths():
    mem = memory()
    agent = Agent()

    async def main() -> None:
        with tracer.trace_attr(step=0, sample_index=0):
            assert agent.gen_sync("ab", n=2) == "abab"
            assert await agent.gen_async("hi") == "hi!"
            assert list(agent.gen_items(3)) == [0, 1, 2]
            assert [x async for x in agent.agen_items(2)] == [0, 10]
            gen = agent.gen_items(10)
            assert next(gen) == 0
            gen.close()  # abandoned half way

    asyncio.run(main())
    assert tracer.flush(10)
    [rec] = mem.records
    spans = rec.spans
    assert [s.name for s in spans] == [
        "trajectory",
        "gen_sync",
        "gen_async",
        "gen_items",
        "agen_items",
        "gen_items",
    ]
    assert spans[1].inputs == {"prompt": "ab", "n": 2} and spans[1].outputs == "abab"
    assert spans[2].inputs == {"prompt": "hi"} and spans[2].outputs == "hi!"
    assert spans[3].outputs == [0, 1, 2] and spans[3].attributes["return_value"] == "done"
    assert spans[4].outputs == [0, 10] and spans[4].kind == "tool"
    assert spans[5].outputs == [0] and spans[5].attributes["generator_closed_early"] is True
    assert all(s.parent_id == spans[0].span_id for s in spans[1:])
    assert all(s.end_ns >= s.start_ns for s in spans)


def test_ops_outside_a_trajectory_are_untraced_and_unchanged():
    mem = memory()
    agent = Agent()
    assert agent.gen_sync("x") == "x"
    assert list(agent.gen_items(2)) == [0, 1]
    assert tracer.flush(10)
    assert mem.records == []
    assert Agent.gen_sync.__name__ == "gen_sync"  # functools.wraps


@tracer.trace_op(kind="tool")
async def echo(n: int, seen: list[Any]):
    try:
        for i in range(n):
            try:
                sent = yield i
            except ValueError as exc:
                sent = f"caught {exc}"
            seen.append(sent)
    finally:
        seen.append("finally")


@tracer.trace_op(kind="parse")
def echo_sync(n: int, seen: list[Any]):
    try:
        for i in range(n):
            try:
                sent = yield i
            except ValueError as exc:
                sent = f"caught {exc}"
            seen.append(sent)
    finally:
        seen.append("finally")


async def drive_echo() -> tuple[list[Any], list[Any]]:
    seen: list[Any] = []
    agen = echo(5, seen)
    got = [await agen.asend(None), await agen.asend("a"), await agen.athrow(ValueError("x"))]
    got.append(await agen.asend({"b": 1}))
    await agen.aclose()
    seen_sync: list[Any] = []
    gen = echo_sync(5, seen_sync)
    got_sync = [gen.send(None), gen.send("a"), gen.throw(ValueError("x")), gen.send({"b": 1})]
    gen.close()
    assert (got_sync, seen_sync) == (got, seen)
    return got, seen


@pytest.mark.parametrize("mode", ["off", "sampled_out", "sampled_in"])
def test_async_generator_gets_asend_athrow_aclose_whatever_the_sampling(mode: str):
    # Program behaviour must not depend on the sampling decision.
    expected = ([0, 1, 2, 3], ["a", "caught x", {"b": 1}, "finally"])

    async def main() -> tuple[list[Any], list[Any]]:
        if mode == "off":  # no tracer.init at all
            return await drive_echo()
        if mode == "sampled_in":
            with tracer.trace_attr(step=0, sample_index=0):
                return await drive_echo()
        # max 1 sample per step: the one with the lower hash is kept, the other sampled out
        kept, dropped = sorted([0, 1], key=lambda i: sample_hash(0, 0, False, i))
        with tracer.trace_attr(step=0, sample_index=kept):
            pass
        with tracer.trace_attr(step=0, sample_index=dropped):
            return await drive_echo()

    mem = None if mode == "off" else memory(max_samples_per_step_per_worker=1)
    assert asyncio.run(main()) == expected
    if mem is None:
        return
    assert tracer.flush(10)
    [rec] = mem.records
    names = [s.name for s in rec.spans]
    if mode == "sampled_in":
        assert names == ["trajectory", "echo", "echo_sync"]
        for span in rec.spans[1:]:
            assert span.outputs == [0, 1, 2, 3]
            assert span.attributes["generator_closed_early"] is True
    else:
        assert names == ["trajectory"]


def test_64_concurrent_trajectories_each_get_their_own_spans():
    mem = memory()

    @tracer.trace_op(kind="tool")
    async def tool(sample: int, turn: int) -> int:
        await asyncio.sleep(0.001 * ((sample * 7 + turn) % 5))
        return sample

    @tracer.trace_op(kind="trajectory")
    async def run(sample: int) -> int:
        total = 0
        for turn in range(3):
            total += await tool(sample, turn)
        return total

    async def one(i: int) -> None:
        with tracer.trace_attr(step=1, sample_index=i):
            await run(i)

    async def main() -> None:
        await asyncio.gather(*[one(i) for i in range(64)])

    asyncio.run(main())
    assert tracer.flush(10)
    assert len(mem.records) == 64
    for rec in mem.records:
        ids = {s.span_id for s in rec.spans}
        run_span = spans_by_name(rec)["run"]
        tools = [s for s in rec.spans if s.name == "tool"]
        assert len(tools) == 3
        assert all(t.inputs["sample"] == rec.sample_index for t in tools)
        assert all(t.parent_id == run_span.span_id for t in tools)
        assert all(s.parent_id in ids for s in rec.spans[1:])
    assert len({r.trace_id for r in mem.records}) == 64


def test_traced_from_threads():
    mem = memory()

    @tracer.trace_op(kind="tool")
    def work(i: int) -> int:
        return i * i

    def worker(i: int) -> None:
        with tracer.trace_attr(step=0, sample_index=i):
            work(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tracer.flush(10)
    assert sorted(r.spans[1].outputs for r in mem.records) == [i * i for i in range(8)]


def test_cancelled_task_is_recorded():
    mem = memory()

    @tracer.trace_op(kind="generate")
    async def slow() -> None:
        await asyncio.sleep(10)

    async def main() -> None:
        async def one() -> None:
            with tracer.trace_attr(step=0, sample_index=0):
                await slow()

        task = asyncio.create_task(one())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert tracer.flush(10)
    [rec] = mem.records
    gen = spans_by_name(rec)["slow"]
    assert gen.status == "ERROR" and gen.error["type"] == "CancelledError"
    assert rec.status == "ERROR"


def test_snapshot_holds_arguments_as_they_were_at_call_time():
    mem = memory()

    @tracer.trace_op(kind="generate")
    def gen(messages: list[dict[str, str]], ids: list[int]) -> list[int]:
        return ids

    messages = [{"role": "user", "content": "q"}]
    ids = list(range(100))
    with tracer.trace_attr(step=0, sample_index=0):
        out = gen(messages, ids)
        messages.append({"role": "assistant", "content": "a"})
        messages[0]["content"] = "changed"
        ids.append(999)
        out.append(1000)
    assert tracer.flush(10)
    span = mem.records[0].spans[1]
    assert span.inputs["messages"] == [{"role": "user", "content": "q"}]
    assert span.inputs["ids"] == list(range(100))
    assert span.outputs == list(range(100))


def test_tokenizer_that_raises_never_reaches_the_rollout():
    mem = memory(token2text=True, raise_internal_errors=False)

    class BadTokenizer:
        def __len__(self) -> int:
            return 100

        def decode(self, ids: Sequence[int], **kw: Any) -> str:
            raise RuntimeError("tokenizer exploded")

    class Loop:
        tokenizer = BadTokenizer()

        @tracer.trace_op(kind="generate")
        def generate(self, prompt_ids: list[int]) -> dict[str, Any]:
            return {"response_ids": [1, 2, 3]}

    with tracer.trace_attr(step=0, sample_index=0):
        assert Loop().generate([4, 5]) == {"response_ids": [1, 2, 3]}
    assert tracer.flush(10)
    [rec] = mem.records
    attrs = rec.spans[1].attributes
    assert "tokenizer exploded" in attrs["token2text_error"]
    assert rec.spans[1].outputs["response_ids"] == [1, 2, 3]


def test_out_of_vocabulary_and_negative_ids_are_marked(smollm2_tokenizer: Any):
    mem = memory(token2text=True)
    tracer.register_tokenizer(smollm2_tokenizer)

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"response_ids": [28, 10_000_000, -1, 28]}

    ok_ids = smollm2_tokenizer.encode("hello world", add_special_tokens=False)
    with tracer.trace_attr(step=0, sample_index=0):
        generate(ok_ids)
    assert tracer.flush(10)
    attrs = mem.records[0].spans[1].attributes
    assert attrs["prompt_text"] == "hello world"
    assert "<invalid token id 10000000>" in attrs["response_text"]
    assert "<invalid token id -1>" in attrs["response_text"]


class _Exploding:
    name = "exploding"

    def __init__(self, config: Any) -> None:
        self.calls = 0

    def export(self, batch: Sequence[TrajectoryRecord]) -> ExportResult:
        self.calls += 1
        raise ConnectionError("backend is down")

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_backend_that_raises_never_reaches_the_rollout_and_is_spooled(tmp_path):
    register_backend("exploding", _Exploding)
    tracer.init(backend=["exploding", "memory"], export_max_retries=1,
                spool_dir=str(tmp_path / "spool"),
                shutdown_timeout_s=1)  # it never recovers: the teardown gives up after 1 s, not 10
    mem = InMemoryExporter.latest()

    @tracer.trace_op(kind="tool")
    def tool(x: int) -> int:
        return x + 1

    for i in range(5):
        with tracer.trace_attr(step=0, sample_index=i):
            assert tool(i) == i + 1
    assert tracer.flush(3) is False  # not everything reached every backend ...
    m = tracer.metrics()
    assert m["tracer/exploding/failed"] == 0 and m["tracer/exploding/retries"] >= 1
    assert m["tracer/exploding/spooled_batches"] >= 1  # ... but nothing is lost
    assert m["tracer/memory/exported"] == 5  # the healthy backend got everything
    assert len(mem.records) == 5
    spooled = list((tmp_path / "spool").glob("exploding-*/*.jsonl"))
    assert sum(len(p.read_text().splitlines()) for p in spooled) == 5


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"backend": "mlfow"}, "unknown trace backend(s) ['mlfow']; valid backends: ["),
        ({"backend": ["jsonl", "nope"]}, "unknown trace backend(s) ['nope']"),
        ({"backnd": "mlflow"}, "TraceConfig(backnd=...): unknown option (did you mean `backend`?)"),
        ({"max_samples_per_step_per_worker": -1}, "must be an integer >= 0, got -1"),
        ({"flush_interval_s": 0}, "flush_interval_s must be > 0"),
        ({"on_backend_error": "ignore"}, "must be one of 'raise', 'warn'"),
    ],
)
def test_configuration_errors_fail_at_init_with_valid_values(config: dict[str, Any], message: str):
    with pytest.raises(tracer.ConfigError) as info:
        tracer.init(config)
    assert message in str(info.value)
    if "backend" in config:
        assert all(f"'{b}'" in str(info.value) for b in ("jsonl", "mlflow", "otlp", "weave"))


def test_backend_that_cannot_start_is_a_clear_error_or_a_warning(caplog: pytest.LogCaptureFixture):
    def broken(config: Any) -> Any:
        raise ImportError("No module named 'fancy_sdk'")

    register_backend("broken", broken)
    with pytest.raises(tracer.TracerInitError, match=r"pip install 'rollout-tracer\[broken\]'"):
        tracer.init(backend="broken")
    tracer.init(backend=["broken", "memory"], on_backend_error="warn")
    assert "tracing goes on without it" in caplog.text
    with tracer.trace_attr(step=0, sample_index=0):
        pass
    assert tracer.flush(10)
    assert len(InMemoryExporter.latest().records) == 1


def test_import_tracer_imports_no_heavy_dependency():
    code = (
        "import sys, tracer; heavy = [m for m in ('mlflow', 'weave', 'torch', 'transformers', "
        "'opentelemetry', 'numpy') if m in sys.modules]; print(heavy)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip() == "[]"


def test_verl_compatible_api_runs_verl_style_code():
    from tracer import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

    RolloutTraceConfig.init(
        "proj", "exp", "memory", token2text=False, max_samples_per_step_per_worker=None
    )
    mem = InMemoryExporter.latest()
    assert RolloutTraceConfig.get_backend() == "memory"

    class ToolAgentLoop:
        @rollout_trace_op
        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> str:
            return await self.generate_sequences(kwargs["raw_prompt"])

        @rollout_trace_op
        async def generate_sequences(self, prompt: str) -> str:
            return prompt[::-1]

    async def main() -> None:
        with rollout_trace_attr(sample_index=4, step=2, rollout_n=1, validate=True):
            await ToolAgentLoop().run({"temperature": 1.0}, raw_prompt="abc")

    asyncio.run(main())
    assert tracer.flush(10)
    [rec] = mem.records
    assert rec.name == "rollout_trace" and (rec.step, rec.sample_index, rec.rollout_n) == (2, 4, 1)
    assert rec.validate is True
    # qualified names, as verl (a class defined in a function: "<locals>." in between)
    assert [(s.name.rsplit("<locals>.", 1)[-1], s.kind) for s in rec.spans] == [
        ("rollout_trace", "trajectory"),
        ("ToolAgentLoop.run", "trajectory"),
        ("ToolAgentLoop.generate_sequences", "generate"),
    ]
    assert rec.spans[1].inputs == {
        "sampling_params": {"temperature": 1.0},
        "kwargs": {"raw_prompt": "abc"},
    }


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_traces_with_its_own_worker(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), raise_internal_errors=True)

    @tracer.trace_op(kind="tool")
    def tool(who: str) -> str:
        return who

    with tracer.trace_attr(step=0, sample_index=0):
        tool("parent-before-fork")
    pid = os.fork()
    if pid == 0:  # child: trace, flush, exit without running the parent's atexit
        code = 1
        try:
            with tracer.trace_attr(step=0, sample_index=1):
                tool("child")
            code = 0 if tracer.flush(20) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tracer.flush(20)
    import json

    from tracer.backends.jsonl_backend import JsonlExporter  # noqa: F401

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    outputs = sorted(rec["spans"][1]["outputs"] for rec in lines)
    assert outputs == ["child", "parent-before-fork"]  # each exactly once


def test_a_thread_that_cannot_start_never_breaks_the_rollout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first trajectory starts the background threads; where the process has hit its
    thread limit, Thread.start raises. The rollout goes on, the error is counted, and once
    threads can start again both trajectories are delivered (the first one waited in the
    buffer). The export worker starts; the processing thread is the one that fails."""
    tracer.init({"backend": "memory", "raise_internal_errors": False})
    real_start = threading.Thread.start

    def no_processor(self: threading.Thread) -> None:
        if self.name == "rollout-tracer":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", no_processor)
    with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
        pass  # ends here, in submit: must not raise
    assert tracer.metrics()["tracer/internal_errors"] == 1
    monkeypatch.setattr(threading.Thread, "start", real_start)
    with tracer.trace_attr(step=0, sample_index=1, rollout_n=0):
        pass
    assert tracer.flush(timeout_s=30)
    assert sorted(r.sample_index for r in InMemoryExporter.latest().records) == [0, 1]
    names = [t.name for t in threading.enumerate() if t.name.startswith("rollout-tracer")]
    names = [n for n in names if n != "rollout-tracer-export-launcher"]  # the child's, if any
    assert sorted(names) == ["rollout-tracer", "rollout-tracer-memory",
                             "rollout-tracer-watchdog"]  # one of each  # fmt: skip
    tracer.reset()


async def test_set_span_attributes_names_the_innermost_op() -> None:
    sink = memory()

    @tracer.trace_op(kind="tool")
    async def tool(name: str) -> str:
        await asyncio.sleep(0)  # two calls interleave: each sets its own span
        tracer.set_span_attributes(tool_schema={"tool": name})
        return name

    @tracer.trace_op(kind="other")
    async def outer() -> None:
        await asyncio.gather(tool("a"), tool("b"))

    tracer.set_span_attributes(ignored=True)  # outside any trajectory: nothing, no error
    with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
        tracer.set_span_attributes(ignored=True)  # no op running: nothing
        await outer()
    assert tracer.flush(timeout_s=30)
    [record] = sink.records
    assert {s.inputs["name"]: s.attributes["tool_schema"]["tool"]
            for s in record.spans if s.kind == "tool"} == {"a": "a", "b": "b"}  # fmt: skip
    assert all("ignored" not in s.attributes for s in record.spans)
    assert "tool_schema" not in spans_by_name(record)["outer"].attributes
