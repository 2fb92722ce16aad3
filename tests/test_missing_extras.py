"""Without an optional extra, a command says which one to install, in one line, and exits 2;
the explorer's search answers 503 with that line; no traceback anywhere.

The missing package is simulated honestly: each command runs in a subprocess whose PYTHONPATH
starts with a folder holding a ``sitecustomize.py`` that sets ``sys.modules[name] = None``.
Python then raises ``ModuleNotFoundError`` ("import of tantivy halted; None in sys.modules")
for ``import tantivy``, ``from tantivy import ...`` and any submodule, exactly the exception a
venv without the package raises (``ModuleNotFoundError`` too, only the message differs), and
nothing else about the interpreter changes. Nothing in the project imports it before the
interpreter starts, so every import path sees the missing module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("tantivy")
pytest.importorskip("pyarrow")

from tests._explore import get, make_export
from tests._servers import free_port

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("missing-extras")

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, *missing: str) -> dict[str, str]:
    shim = tmp_path / f"without-{'-'.join(missing)}"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in missing))
    path = os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)  # fmt: skip


def test_the_shim_makes_the_import_fail(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import tantivy"], env=_env(tmp_path, "tantivy"),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr


@pytest.mark.parametrize("module", ["duckdb", "pyarrow"])
def test_explore_without_duckdb_or_pyarrow(tmp_path: Path, module: str) -> None:
    folder = make_export(tmp_path / "run", 10, seed=1)
    done = _cli(["explore", "--from", "parquet", "--path", str(folder), "--port", "0",
                 "--cache-dir", str(tmp_path / "cache")], _env(tmp_path, module))  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"rollout-tracer explore: error: {module} is not installed: "
                                   "pip install 'rollout-tracer[explore]'")  # fmt: skip
    assert done.stdout == ""


def test_export_without_pyarrow(tmp_path: Path) -> None:
    import tracer
    from tests.test_export import _records
    from tracer.backends.jsonl_backend import JsonlExporter

    path = tmp_path / "t.jsonl"
    JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(path))).export(_records(5))
    env = _env(tmp_path, "pyarrow")
    done = _cli(["export", "--from", "jsonl", "--path", str(path), "--out", str(tmp_path / "x"),
                 "--no-progress"], env)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("rollout-tracer export: error: pyarrow is not installed: "
                                   "pip install 'rollout-tracer[export]'")  # fmt: skip
    assert not (tmp_path / "x").exists()
    # JSON lines need no pyarrow
    done = _cli(["export", "--from", "jsonl", "--path", str(path), "--out", str(tmp_path / "j"),
                 "--format", "jsonl", "--no-progress"], env)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_explore_without_tantivy_serves_and_search_says_why(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "run", 30, seed=1)
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "explore", "--from", "parquet",
                             "--path", str(folder), "--port", "0", "--cache-dir",
                             str(tmp_path / "cache")], env=_env(tmp_path, "tantivy"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("http://" in s for s in seen):
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
        url = next(s for s in seen if "http://" in s).split("http://", 1)[1].split("/", 1)[0]
        base = f"http://{url}/"
        install = "tantivy is not installed: pip install 'rollout-tracer[explore]'"
        status, body = get(base, "api/search", q="timeout")
        assert status == 503 and body == {"error": install}
        assert get(base, "api/status")[1]["runs"][0]["search"] == {
            "state": "off", "percent": None, "error": install}  # fmt: skip
        assert get(base, "api/list", size=1)[1]["total"] == 30  # everything else works
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    seen.append(out)
    assert proc.returncode == 0
    text = "".join(seen)
    assert f"rollout-tracer explore: search is off: {install}" in text
    assert "Traceback" not in text and "ModuleNotFoundError" not in text


# Every command, with each optional package hidden in turn: what it needs the package for.
# {jsonl}, {parquet}, {uri}, {tmp} are filled in by the test; each list runs in one
# interpreter (tests/_missing_extras_run.py), a fork per command.
NEEDS = {
    "pyarrow": [
        ["export", "--from", "jsonl", "--path", "{jsonl}", "--out", "{tmp}/x", "--no-progress"],
        ["report", "--from", "jsonl", "--path", "{jsonl}", "--out", "{tmp}/r.html"],
        ["flags", "--from", "jsonl", "--path", "{jsonl}"],
        ["explore", "--from", "jsonl", "--path", "{jsonl}", "--port", "0"],
    ],
    "duckdb": [
        ["report", "--from", "jsonl", "--path", "{jsonl}", "--out", "{tmp}/r.html"],
        ["flags", "--from", "jsonl", "--path", "{jsonl}"],
        ["explore", "--from", "parquet", "--path", "{parquet}", "--port", "0"],
    ],
    "mlflow": [
        # a sqlite store is read without MLflow (tracer/readers/mlflow_sqlite.py): a server's
        # needs MLflow's client (nothing listens there: the import comes first)
        ["export", "--from", "mlflow", "--tracking-uri", "{server}", "--out", "{tmp}/x",
         "--no-progress"],
        ["report", "--from", "mlflow", "--tracking-uri", "{server}", "--out", "{tmp}/r.html"],
        ["flags", "--from", "mlflow", "--tracking-uri", "{server}"],
        ["explore", "--from", "mlflow", "--tracking-uri", "{server}", "--port", "0"],
        ["ui", "--tracking-uri", "{uri}"],
        ["run", "actor_rollout_ref.rollout.trace.backend=mlflow"],
        ["replay", "--spool-dir", "{mlflow_spool}"],  # a batch waits for the sqlite store
    ],
    "opentelemetry": [["replay", "--spool-dir", "{otlp_spool}"]],
    "weave": [
        ["export", "--from", "weave", "--experiment", "p", "--entity", "e", "--out", "{tmp}/x",
         "--no-progress"],
        ["report", "--from", "weave", "--experiment", "p", "--entity", "e", "--out",
         "{tmp}/r.html"],
        ["flags", "--from", "weave", "--experiment", "p", "--entity", "e"],
        ["run", "actor_rollout_ref.rollout.trace.backend=weave"],
    ],
    "trackio": [
        ["run", "actor_rollout_ref.rollout.trace.backend=trackio"],
        ["run", "trainer.logger=[console,trackio]"],
    ],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A JSONL file, an export folder and an MLflow store with the same few trajectories."""
    import tracer
    from tests.test_export import _records
    from tracer.backends.jsonl_backend import JsonlExporter

    tmp = tmp_path_factory.mktemp("sources")
    jsonl = tmp / "t.jsonl"
    JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(jsonl))).export(_records(5))
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tracer.init(backend="mlflow", tracking_uri=uri, project_name="rollout-tracer",
                export_in_subprocess=False, spool_dir=str(tmp / "spool"))  # fmt: skip
    try:
        for i in range(3):
            with tracer.trace_attr(step=0, sample_index=i):
                pass
        assert tracer.flush(60)
    finally:
        tracer.reset()
    return {"jsonl": str(jsonl), "parquet": str(make_export(tmp / "run", 10, seed=1)),
            "uri": uri, "mlflow_spool": _spool(tmp / "mlflow-spool", "mlflow", uri),
            "otlp_spool": _spool(tmp / "otlp-spool", "otlp", "http://127.0.0.1:9/v1/traces")}


def _spool(root: Path, backend: str, where: str) -> str:
    """A spool holding one batch for ``backend`` at ``where``, left by a process that is gone."""
    import tracer
    from tests.test_export import _records
    from tracer.encode import encode_record
    from tracer.spool import BackendSpool

    field = "tracking_uri" if backend == "mlflow" else "otlp_endpoint"
    config = tracer.TraceConfig(backend=backend, **{field: where})
    spool = BackendSpool(str(root), backend, where, config, 1 << 20)
    spool.write([encode_record(r) for r in _records(1)])
    spool.release()
    return str(root)


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("module", sorted(NEEDS))
def test_every_command_without_an_extra_says_one_line_and_exits_2(
    tmp_path: Path, sources: dict[str, str], module: str
) -> None:
    """The package is hidden; every command that needs it prints one line naming the extra
    to install and exits 2: no traceback, whatever the import path (the central handler in
    rollout/cli.py main and rollout/extras.py)."""
    import json

    from rollout.extras import missing_extra_line

    fill = {**sources, "tmp": str(tmp_path), "server": f"http://127.0.0.1:{free_port()}"}
    commands = [[arg.format(**fill) for arg in argv] for argv in NEEDS[module]]
    spec, out = tmp_path / "commands.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"cwd": str(tmp_path), "commands": commands}))
    done = subprocess.run([sys.executable, "-m", "tests._missing_extras_run", str(spec),
                           str(out)], env=_env(tmp_path, module), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    problems = []
    for result in json.loads(out.read_text()):
        command = result["argv"][0]
        expected = missing_extra_line(ModuleNotFoundError(name=module), command)
        lines = result["stderr"].strip().splitlines()
        # the central line; a command may say it in its own words (trainer.logger's check)
        # as long as it is one line that names the extra to install
        install = str(expected).split(": ", 1)[1]
        if result["status"] != 2 or len(lines) != 1 or not (
            lines[0] == f"rollout-tracer {command}: error: {expected}"
            or (lines[0].startswith("rollout-tracer") and install in lines[0])
        ):
            problems.append(f"{' '.join(result['argv'][:3])}: exit {result['status']}, "
                            f"stderr {result['stderr'][-1500:]!r}")  # fmt: skip
    assert not problems, "\n".join(problems)
