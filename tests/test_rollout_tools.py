"""Tools: calculator safety, the Python runner's limits, isolation and process cleanup,
retrieval, bad calls."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path

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


async def test_a_traced_call_records_the_tools_schema() -> None:
    """The registry names the tool's JSON schema on its span (OpenInference's tool.parameters,
    tests/test_openinference.py); an unknown tool has none."""
    import tracer
    from tracer.testing import InMemoryExporter

    tracer.init({"backend": "memory", "raise_internal_errors": True})
    tools = default_tools(["calculator"])
    with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
        await tools.call("calculator", {"expression": "6 / 3"})
        await tools.call("nope", {})
    assert tracer.flush(timeout_s=30)
    [record] = InMemoryExporter.latest().records
    known, unknown = (s for s in record.spans if s.kind == "tool")
    assert known.attributes["tool_schema"] == Calculator.parameters
    assert known.attributes["tool_name"] == "calculator" and known.outputs["content"] == "2"
    assert "tool_schema" not in unknown.attributes


def test_default_tools_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="valid: calculator, python, search"):
        default_tools(["calculator", "web"])


async def test_python_runner_limits_apply_in_the_child(tmp_path) -> None:
    # The limits are set without preexec_fn (unsafe in a threaded process); check that they
    # still reach the interpreter that runs the code, and that exceeding one stops the tool.
    runner = PythonRunner(memory_mb=200, timeout_s=3, writable_dir=str(tmp_path))
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


# --------------------------------------------------------------------------- no survivors
# Model code that forks, leaves the process group with setsid(), forks again (the grandchild
# is orphaned) and loops appending to a file in the folder it may write to.
_ESCAPE = """\
import os, time
# {marker}
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open("pids", "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        while True:
            with open("grows", "a") as f:
                f.write("x")
            time.sleep(0.005)
    os._exit(0)
with open("pids", "a") as f:
    f.write(f"{{os.getpid()}}\\n")
time.sleep(60)
"""


def _bwrap_or_skip() -> None:
    from rollout import code_runner

    path = code_runner.find_bwrap()
    if path is None:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")
    if why := code_runner.bwrap_works(path):
        pytest.skip(f"bwrap cannot create namespaces here: {why}")


def _processes_with(marker: str) -> list[int]:
    """Host PIDs whose command line holds ``marker`` (the code is on it: ``-c CODE``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
@pytest.mark.parametrize("isolation", ["none", "bwrap"])
async def test_python_runner_kills_a_setsid_escape_on_timeout(isolation: str, tmp_path) -> None:
    if isolation == "bwrap":
        _bwrap_or_skip()
    marker = f"escape-{uuid.uuid4().hex}"
    runner = PythonRunner(timeout_s=1.5, isolation=isolation, writable_dir=str(tmp_path))
    with pytest.raises(ToolError, match="timed out"):
        await runner.execute(code=_ESCAPE.format(marker=marker))
    grows = tmp_path / "grows"
    assert grows.stat().st_size > 0  # the escape did run
    assert _processes_with(marker) == []
    if isolation == "none":  # with bwrap the PIDs it wrote are those of its own namespace
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 2 and not [p for p in pids if _alive(p)]
    size = grows.stat().st_size
    time.sleep(0.3)
    assert grows.stat().st_size == size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
async def test_python_runner_leaves_no_process_behind_after_a_normal_exit(tmp_path) -> None:
    marker = f"leftover-{uuid.uuid4().hex}"
    code = _ESCAPE.format(marker=marker).replace("time.sleep(60)", "time.sleep(0.3)")
    runner = PythonRunner(timeout_s=10, isolation="none", writable_dir=str(tmp_path))
    assert await runner.execute(code=code) == "(no output)"
    assert _processes_with(marker) == []


async def test_bwrap_hides_host_files_and_network(tmp_path) -> None:
    _bwrap_or_skip()
    secret = tmp_path / "home" / ".bashrc"
    secret.parent.mkdir()
    secret.write_text("export API_KEY=hunter2\n")
    host_tmp = f"/tmp/python-tool-{uuid.uuid4().hex}"
    home_file = next((p for p in Path.home().iterdir() if p.is_file()), secret)  # ~/.bashrc...
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import os, socket\n"
            f"print(os.path.exists({str(secret)!r}), os.path.exists({str(home_file)!r}),"
            f" os.path.exists({os.getcwd()!r}))\n"
            f"open({host_tmp!r}, 'w').write('x')\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('no network', exc.errno)\n"
        )
        out = await PythonRunner(isolation="bwrap", timeout_s=10).execute(code=code)
    assert out.splitlines()[0] == "False False False"
    assert out.splitlines()[1].startswith("no network")
    assert not os.path.exists(host_tmp)  # its /tmp is its own


async def test_python_runner_without_bwrap(monkeypatch, caplog) -> None:
    """isolation="bwrap" fails loudly where bwrap is missing; "auto" says once that the code
    runs without file-system and network isolation, and still runs it."""
    from rollout import code_runner

    monkeypatch.setattr(code_runner, "find_bwrap", lambda: None)
    code_runner._warn_once.cache_clear()
    with pytest.raises(ValueError, match="isolation='bwrap' but bwrap is not installed"):
        await PythonRunner(isolation="bwrap").execute(code="print(1)")
    with caplog.at_level(logging.WARNING, logger="rollout"):
        for _ in range(2):
            assert await PythonRunner().execute(code="print(1)") == "1"
    lines = [r.getMessage() for r in caplog.records if "WITHOUT file-system" in r.getMessage()]
    assert len(lines) == 1 and "bwrap is not installed" in lines[0]
    with pytest.raises(ValueError, match="isolation must be one of auto, bwrap, none"):
        PythonRunner(isolation="sandbox")
