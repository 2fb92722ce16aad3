"""Tools: calculator safety, the sandboxed Python runner's limits, retrieval, bad calls."""

from __future__ import annotations

import os
import time

import pytest

from rollout.tools import Calculator, PythonRunner, Retriever, ToolError, default_tools, safe_eval


@pytest.mark.parametrize(
    ("expr", "value"),
    [("2+3*4", 14), ("(12 + 30) * 3 / 2", 63.0), ("2**10", 1024), ("-7 // 2", -4),
     ("sqrt(16) + abs(-2)", 6.0), ("1,234 + 1", 1235), ("3^2", 9), ("max(1, 5, 3)", 5)],
)  # fmt: skip
def test_calculator_values(expr: str, value: float) -> None:
    assert safe_eval(expr) == value


@pytest.mark.parametrize(
    "expr",
    ["__import__('os')", "__import__('os').system('echo hi')", "open('/etc/passwd')",
     "(1).__class__", "[x for x in range(10)]", "9**9**9", "10**1000", "2**-5000", "a + 1",
     "lambda: 1", "'a' * 3", "1/0", "x" * 600],
)  # fmt: skip
def test_calculator_rejects_unsafe_or_huge(expr: str) -> None:
    with pytest.raises(ToolError):
        safe_eval(expr)


async def test_calculator_tool_formats_integers() -> None:
    assert await Calculator().execute(expression="6 / 3") == "2"


async def test_python_runner_runs_and_captures_stdout() -> None:
    out = await PythonRunner().execute(code="print(sum(range(10)))")
    assert out == "45"


async def test_python_runner_timeout_kills_it() -> None:
    runner = PythonRunner(timeout_s=1.0)
    start = time.perf_counter()
    with pytest.raises(ToolError, match="timed out"):
        await runner.execute(code="import time\nwhile True: time.sleep(0.01)")
    assert time.perf_counter() - start < 5


async def test_python_runner_memory_limit() -> None:
    runner = PythonRunner(memory_mb=128, timeout_s=10)
    with pytest.raises(ToolError, match=r"MemoryError|resource limit"):
        await runner.execute(code="x = bytearray(512 * 1024 * 1024)\nprint(len(x))")


async def test_python_runner_error_is_reported() -> None:
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        await PythonRunner().execute(code="print(1/0)")


async def test_retrieval_finds_relevant_passage() -> None:
    hits = Retriever().search("how many centimeters in a meter", top_k=1)
    assert hits and "centimeters" in hits[0][1]["text"]
    assert "12 items" in await Retriever().execute(query="dozen eggs")


@pytest.mark.parametrize(
    ("name", "arguments", "parse_error", "expect"),
    [
        ("nope", {}, None, "unknown tool 'nope'"),
        ("calculator", {}, None, "missing required argument"),
        ("calculator", {"expression": "1", "x": 2}, None, "unknown argument"),
        ("calculator", {"expression": 5}, None, "must be of type string"),
        ("calculator", {"expression": "__import__('os')"}, None, "unsupported syntax"),
        ("search", {"query": "a", "top_k": 99}, None, "top_k"),
        ("python", {"code": "raise SystemExit(3)"}, None, "exit code 3"),
        ("", {}, "invalid JSON in tool call", "invalid JSON"),
    ],
)
async def test_bad_calls_become_error_results(name, arguments, parse_error, expect) -> None:
    result = await default_tools().call(name, arguments, parse_error=parse_error)
    assert not result.ok and expect in result.error
    assert result.content.startswith("Error: ")


async def test_crashing_tool_is_an_error_result() -> None:
    class Boom(Calculator):
        name = "boom"

        async def execute(self, **arguments):  # type: ignore[override]
            raise RuntimeError("kaput")

    from rollout.tools import ToolRegistry

    result = await ToolRegistry([Boom()]).call("boom", {"expression": "1"})
    assert result.error == "RuntimeError: kaput"


def test_default_tools_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="valid: calculator, python, search"):
        default_tools(["calculator", "web"])


async def test_python_runner_limits_apply_in_the_child(tmp_path) -> None:
    # The limits are set without preexec_fn (unsafe in a threaded process); check that they
    # still reach the interpreter that runs the code, and that exceeding one stops the tool.
    runner = PythonRunner(memory_mb=200, timeout_s=3)
    out = await runner.execute(
        code="import resource as r\n"
        "print([r.getrlimit(getattr(r, n)) for n in "
        "('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_CORE')])"
    )
    mem = 200 * 1024 * 1024
    assert out == str([(mem, mem), (4, 4), (1 << 20, 1 << 20), (0, 0)])
    big = tmp_path / "big.bin"
    with pytest.raises(ToolError, match="File too large"):
        await runner.execute(code=f"open({str(big)!r}, 'wb').write(b'x' * (2 << 20))")
    assert big.stat().st_size <= 1 << 20


_forks_with_python: list[int] = []
os.register_at_fork(before=lambda: _forks_with_python.append(os.getpid()))


async def test_python_runner_runs_no_python_between_fork_and_exec() -> None:
    # preexec_fn makes subprocess fork and run Python in the child before exec: every at-fork
    # handler runs (the tracer's pipeline restarts its worker in the child), and in a process
    # with threads the child can deadlock on a lock another thread held. Without preexec_fn
    # the child goes straight to exec and no at-fork handler runs.
    before = len(_forks_with_python)
    assert await PythonRunner().execute(code="print('ok')") == "ok"
    assert len(_forks_with_python) == before
