"""How the export child starts, as a user never notices it (``tracer/backends/child_launch.py``):
isolated from the user's folder, started by a thread that lives as long as the process, its
whole process group killed when the start fails, no pipe of a start in progress in a fork, the
same settings in a fork as in its parent, and its libraries' log lines kept to itself.

Each test runs a small traced script in a process of its own (as in tests/test_export_child.py),
reads the store back with MLflow's client and checks that no process it started is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._procs import running
from tests.test_export_child import PRELUDE, keys, stored, wait_gone
from tracer.backends.child_launch import child_path, tracer_root

pytest.importorskip("mlflow")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.export_child,
]

ROOT = Path(__file__).resolve().parents[1]


class Job:
    """A traced script at ``tmp/bin/job.py``, run from ``cwd`` (the user's folder) in a
    session of its own; it prints one JSON object per line."""

    def __init__(self, tmp: Path, uri: str, body: str, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        script = tmp / "bin" / "job.py"
        script.parent.mkdir(exist_ok=True)
        script.write_text(PRELUDE.format(uri=uri, spool=str(tmp / "spool")) + textwrap.dedent(body))
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=cwd or tmp, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )  # fmt: skip
        self.said: dict[str, Any] = {}

    def read(self, key: str) -> Any:
        assert self.proc.stdout is not None
        while key not in self.said:
            line = self.proc.stdout.readline()
            assert line, f"the script ended without {key!r}: {self.finish()}"
            self.said.update(json.loads(line))
        return self.said[key]

    def finish(self, timeout: float = 120.0) -> str:
        out, err = self.proc.communicate(timeout=timeout)
        for line in out.splitlines():
            self.said.update(json.loads(line))
        return str(err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        child = self.said.get("child")
        if isinstance(child, int) and running(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def test_the_childs_path_is_the_parents_without_its_folder(tmp_path: Path) -> None:
    """'' and the working directory (the user's folder) are left out, a relative entry is made
    absolute as the parent sees it, and this tracer's folder comes before the first other
    folder that holds a ``tracer``."""
    user = tmp_path / "user"
    (user / "tracer").mkdir(parents=True)
    shadow = tmp_path / "shadow"
    (shadow / "tracer").mkdir(parents=True)
    root = tracer_root()
    assert child_path(["", str(user), root, "/usr/lib"], str(user)) == [root, "/usr/lib"]
    assert child_path(["/usr/lib", str(shadow), root], "/nowhere") == ["/usr/lib", root,
                                                                        str(shadow)]  # fmt: skip
    assert child_path(["/usr/lib", "rel"], "/nowhere") == [root, "/usr/lib",
                                                           os.path.abspath("rel")]  # fmt: skip


def test_the_child_imports_nothing_from_the_users_folder(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job]
) -> None:
    """The user's folder holds an ``orjson.py``, a ``mlflow.py`` and a ``tracer/`` package
    that print and raise when imported; the job runs from there (its script lives elsewhere,
    so the job itself does not import them). The child imports none of them: it starts,
    exports, prints nothing, and is the only child started."""
    user = tmp_path / "user"
    (user / "tracer").mkdir(parents=True)
    shadow = "print('USER FILE IMPORTED', __name__)\nraise RuntimeError('the user file')\n"
    for name in ("orjson.py", "mlflow.py", "tracer/__init__.py"):
        (user / name).write_text(shadow)
    job = Job(tmp_path, mlflow_uri, """
        exporter = init()
        trace(0, 20)
        say(ok=tracer.flush(60), kind=type(exporter).__name__, starts=exporter.starts,
            child=exporter.pid)
    """, cwd=user)  # fmt: skip
    jobs.append(job)
    err = job.finish()
    assert job.proc.returncode == 0, err
    assert job.said["kind"] == "SubprocessExporter", err
    assert job.said["ok"] and job.said["starts"] == 1, err
    assert "USER FILE" not in err + json.dumps(job.said), err
    # the child said nothing, but for the one line an MLflow the bulk writer was not tested
    # with earns (the lowest supported MLflow), said once, by the child that makes the backend
    said = [ln for ln in err.splitlines() if "not using the bulk writer" not in ln]
    assert not any("export process" in ln for ln in said) and "Traceback" not in err, err
    assert stored(mlflow_uri) == keys(0, 20)
    wait_gone(job.said["child"])


WRAPPER = """#!/bin/sh
sleep 600 &
echo $$ $! >> {marker}
wait
"""


def test_a_failed_start_kills_the_childs_whole_process_group(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job]
) -> None:
    """``sys.executable`` is a wrapper script that runs a command without ``exec`` (here
    ``sleep 600``) and never answers. The start deadline (lowered to 2 s) kills the wrapper
    and its child: nothing is left, and the job exports in its own process."""
    fake = tmp_path / "wrap" / "python3"
    fake.parent.mkdir()
    marker = tmp_path / "started"
    fake.write_text(WRAPPER.format(marker=marker))
    fake.chmod(0o755)
    job = Job(tmp_path, mlflow_uri, f"""
        sys.executable = {str(fake)!r}
        import tracer.backends.subprocess_proxy as proxy
        proxy.START_TIMEOUT_S = 2.0
        exporter = init()
        trace(0, 10)
        say(ok=tracer.flush(60), kind=type(exporter).__name__)
    """)  # fmt: skip
    jobs.append(job)
    try:
        err = job.finish()
        assert job.proc.returncode == 0, err
        assert job.said["ok"] and job.said["kind"] == "MlflowExporter", err
        assert "exports from this process" in err, err
        pids = [int(p) for p in marker.read_text().split()]
        assert len(pids) == 2  # the wrapper and its sleep
        wait_gone(*pids)
    finally:
        for pid in map(int, marker.read_text().split() if marker.exists() else []):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert stored(mlflow_uri) == keys(0, 10)


def test_init_from_a_thread_that_ends_keeps_the_child_until_the_process_dies(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job]
) -> None:
    """``tracer.init()`` from a short-lived thread: the child outlives the thread (the same one
    exports, no "was killed" line), and still dies when the process is SIGKILLed."""
    job = Job(tmp_path, mlflow_uri, """
        import threading
        box = []
        thread = threading.Thread(target=lambda: box.append(init()))
        thread.start()
        thread.join()
        exporter = box[0]
        trace(0, 20)
        say(ok=tracer.flush(60), starts=exporter.starts, child=exporter.pid)
        time.sleep(600)
    """)  # fmt: skip
    jobs.append(job)
    child = job.read("child")
    assert job.said["ok"] and job.said["starts"] == 1
    assert running(child)
    job.proc.send_signal(signal.SIGKILL)
    err = job.finish()
    assert "was killed" not in err, err
    wait_gone(child)
    assert stored(mlflow_uri) == keys(0, 20)


@pytest.mark.slow(seconds=9)
@pytest.mark.parametrize("variable", ["1", None])
def test_a_fork_honours_the_variable_its_parent_was_started_with(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job], variable: str | None
) -> None:
    """With ``ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS=1`` the parent may not fall back to exporting
    in process, and neither may its fork: a fork that cannot start its child keeps its batches
    (in the spool) instead of exporting in process. Without the variable it falls back, with
    one warning."""
    job = Job(tmp_path, mlflow_uri, """
        exporter = init(export_max_retries=0)
        trace(0, 5)
        assert tracer.flush(60)
        pid = os.fork()
        if pid == 0:
            import multiprocessing
            sys.executable = "/nowhere/uwsgi"  # no Python to start a child with
            multiprocessing.set_executable(sys.executable)
            trace(0, 5, step=1)
            mine = tracer.get_tracer().pipeline.workers[0].exporter
            say(fork_ok=tracer.flush(FLUSH_S), fell_back=mine._local is not None)
            os._exit(0)
        os.waitpid(pid, 0)
        say(child=exporter.pid)
    """.replace("FLUSH_S", "3" if variable else "60"),  # falling back imports MLflow: seconds
              env={"ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS": variable} if variable else None,
              )  # fmt: skip
    jobs.append(job)
    err = job.finish()
    assert job.proc.returncode == 0, err
    if variable:
        assert job.said["fell_back"] is False and job.said["fork_ok"] is False, err
        assert "exports from this process" not in err, err
        assert stored(mlflow_uri) == keys(0, 5)
    else:
        assert job.said["fell_back"] is True and job.said["fork_ok"] is True, err
        assert "exports from this process" in err, err
        assert stored(mlflow_uri) == sorted(keys(0, 5) + keys(1, 5))
    wait_gone(job.said["child"])


@pytest.mark.slow(seconds=8)
def test_a_fork_during_the_childs_start_holds_none_of_its_pipes(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job]
) -> None:
    """Another thread forks at the worst moment: the start has made the child's pipes and is
    about to run it. The fork closes every one of them (the child would otherwise never see
    EOF while the fork lives)."""
    job = Job(tmp_path, mlflow_uri, """
        import subprocess
        real_popen = subprocess.Popen
        held = []
        def popen(*args, **kwargs):
            if not any("export_process" in str(arg) for arg in args[0]):  # MLflow's git
                return real_popen(*args, **kwargs)
            read, write = os.pipe()
            pid = os.fork()  # what another thread's fork sees during the start
            if pid == 0:
                pipes = set()
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        target = os.readlink(f"/proc/self/fd/{fd}")
                    except OSError:
                        continue
                    if target.startswith("pipe:"):
                        pipes.add(int(target[6:-1]))
                os.write(write, json.dumps(sorted(pipes)).encode())
                os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            held.extend(json.loads(os.read(read, 1 << 16)))
            os.close(read)
            subprocess.Popen = real_popen
            return real_popen(*args, **kwargs)
        subprocess.Popen = popen
        exporter = init()
        channel = exporter._channel
        ours = sorted({os.fstat(fd).st_ino for fd in (channel.read_fd, channel.write_fd)})
        trace(0, 5)
        say(ok=tracer.flush(60), ours=ours, held=held, child=exporter.pid)
    """)  # fmt: skip
    jobs.append(job)
    err = job.finish()
    assert job.proc.returncode == 0, err
    assert job.said["ok"] and len(job.said["ours"]) == 2 and job.said["held"], err
    assert not set(job.said["ours"]) & set(job.said["held"]), job.said
    wait_gone(job.said["child"])


@pytest.mark.slow(seconds=30)
def test_the_childs_libraries_log_nothing_on_the_users_stderr(
    tmp_path: Path, postgres_uri: str, jobs: list[Job]
) -> None:
    """PostgreSQL drops the child's connection in the middle of a write (its backend is
    terminated while it waits on a lock): MLflow logs "ERROR mlflow.store.db.utils: SQLAlchemy
    database error" with a traceback in the child. None of it reaches the job's stderr; the
    outage is the parent's lines, and every trajectory is stored, once."""
    import psycopg2

    dsn = postgres_uri.replace("+psycopg2", "")
    name = f"child_logs_{os.getpid()}_{tmp_path.name[-12:]}".lower().replace("-", "_")
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    dsn = dsn.rsplit("/", 1)[0] + "/" + name
    uri = postgres_uri.rsplit("/", 1)[0] + "/" + name
    try:
        job = Job(tmp_path, uri, f"""
            import psycopg2
            exporter = init(export_max_retries=0, flush_interval_s=0.05)
            trace(0, 5)
            assert tracer.flush(60)
            locker = psycopg2.connect({dsn!r})
            locker.cursor().execute("LOCK TABLE trace_info IN ACCESS EXCLUSIVE MODE")
            trace(5, 5)
            admin = psycopg2.connect({dsn!r})
            admin.autocommit = True
            cur = admin.cursor()
            killed = 0
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:  # the child's write waits
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                            "wait_event_type = 'Lock' AND datname = current_database()")
                killed = len(cur.fetchall())
                time.sleep(0.05)
            locker.rollback()
            say(killed=killed, ok=tracer.flush(60), child=exporter.pid, starts=exporter.starts)
        """)  # fmt: skip
        jobs.append(job)
        err = job.finish()
        assert job.proc.returncode == 0, err
        assert job.said["killed"] == 1 and job.said["ok"] is True, err
        assert job.said["starts"] == 1, err  # the child lived on: the error was the store's
        assert "SQLAlchemy" not in err and "ERROR mlflow" not in err, err
        assert "Traceback" not in err and "export process" not in err, err
        assert stored(uri) == keys(0, 10)
        wait_gone(job.said["child"])
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


def test_the_users_process_never_imports_the_backends_library(
    tmp_path: Path, mlflow_uri: str, jobs: list[Job]
) -> None:
    """The export child makes the MLflow backend, and only it: the job's process imports
    neither MLflow nor SQLAlchemy (before, init made the backend here first to see that it
    starts: ~2,300 modules, ~300,000 objects for the job's garbage collector, ~230 MiB). The
    child creates the store's schema and says nothing of it on the job's stderr."""
    mlflow_uri = f"sqlite:///{tmp_path / 'fresh.db'}"  # an empty store: the schema is made
    job = Job(tmp_path, mlflow_uri, """
        import gc
        exporter = init()
        trace(0, 10)
        say(ok=tracer.flush(60), kind=type(exporter).__name__, spool=exporter.spool_key,
            child=exporter.pid, imported=sorted(m for m in ("mlflow", "sqlalchemy", "polars")
                                                if m in sys.modules))
    """)  # fmt: skip
    jobs.append(job)
    err = job.finish()
    assert job.proc.returncode == 0, err
    assert job.said["ok"] and job.said["kind"] == "SubprocessExporter", err
    assert job.said["imported"] == []
    said = "\n".join(ln for ln in err.splitlines() if "not using the bulk writer" not in ln)
    assert "mlflow" not in said.lower() and "export process" not in said, err  # see above
    # the spool is named for the store and experiment, as the exporter made here named it
    assert job.said["spool"].startswith(mlflow_uri) and job.said["spool"].endswith("#1")
    assert stored(mlflow_uri) == keys(0, 10)
    wait_gone(job.said["child"])


def test_a_backend_the_child_cannot_make_is_an_init_error_with_its_reason(
    tmp_path: Path, jobs: list[Job]
) -> None:
    """The child's error is the init's, one line, in the backend's own words; with
    ``on_backend_error='warn'`` the job goes on without the backend."""
    (tmp_path / "a-file").write_text("")  # the store's folder cannot be made under a file
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    job = Job(tmp_path, uri, """
        try:
            init()
        except tracer.TracerInitError as exc:
            say(error=str(exc))
        tracer.init(backend="mlflow", tracking_uri=tracer.get_tracer().config.tracking_uri,
                    project_name="p", on_backend_error="warn")
        say(active=tracer.get_tracer().active)
    """.replace("tracer.get_tracer().config.tracking_uri", repr(uri)))  # fmt: skip
    jobs.append(job)
    err = job.finish()
    assert job.proc.returncode == 0, err
    said = job.said["error"]
    assert said.startswith("rollout-tracer: backend 'mlflow' could not start: "), said
    assert "FileExistsError" in said and "a-file" in said and "\n" not in said, said
    assert job.said["active"] is False  # no backend left: tracing is off, the job goes on
    assert "could not start" in err and "on_backend_error='warn'" in err, err
    assert "Traceback" not in err, err
