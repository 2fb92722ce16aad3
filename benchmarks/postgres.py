"""A throwaway PostgreSQL server for benchmarks and tests: ``initdb`` in a temporary folder,
``postgres`` listening on localhost at a free port, stopped (fast) on exit. Needs PostgreSQL's
server binaries (``initdb``, ``pg_ctl``) and psycopg2; run as root, it runs them as the
``postgres`` user."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _bin(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else where Debian puts it
    (``/usr/lib/postgresql/<version>/bin``, not on PATH), newest version first."""
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).exists():
            return str(folder / name)
    return None


def postgres_available() -> str:
    """'' when a temporary server can be started here, else why not."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed (pip install 'rollout-tracer[postgres]')"
    if not _bin("initdb") or not _bin("pg_ctl"):
        return "PostgreSQL's initdb/pg_ctl are not installed (apt-get install postgresql)"
    if os.geteuid() == 0 and not shutil.which("runuser"):
        return "running as root without runuser"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A running throwaway cluster: its databases' URIs, its data folder, how to run its tools."""

    uris: list[str]
    data: Path
    as_user: list[str]

    def run(self, name: str, *args: str) -> None:
        exe = _bin(name) or name
        subprocess.run([*self.as_user, exe, *args], check=True, capture_output=True, timeout=120)

    def postmaster_pid(self) -> int:
        """The server's process id (the first line of ``postmaster.pid``)."""
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut; the server is up on return."""
        # -l: else the new server logs to pg_ctl's output, a pipe that then never closes
        log = str(self.data.parent / "log")
        self.run("pg_ctl", "-D", str(self.data), "-l", log, "-m", "fast", "-w", "restart")


@contextmanager
def temporary_postgres(*databases: str) -> Iterator[list[str]]:
    """Yields SQLAlchemy URIs (``postgresql+psycopg2://...``) of empty databases, one per
    name in ``databases`` (default: one named ``mlflow``)."""
    with temporary_cluster(*databases) as cluster:
        yield cluster.uris


@contextmanager
def temporary_cluster(*databases: str) -> Iterator[Cluster]:
    """A throwaway server with empty databases named ``databases`` (default: ``mlflow``)."""
    root = Path(tempfile.mkdtemp(prefix="rt-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()
    names = databases or ("mlflow",)
    uris = [f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{name}" for name in names]
    cluster = Cluster(uris, data, as_user)
    try:
        cluster.run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        # the restart (pg_ctl restart) keeps these options: postmaster.opts
        cluster.run(
            "pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=on "
            "-c shared_preload_libraries=pg_stat_statements",
            "start",
        )  # fmt: skip
        try:
            for name in names:
                cluster.run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", name)
            yield cluster
        finally:
            cluster.run("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
