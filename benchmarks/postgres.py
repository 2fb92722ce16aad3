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
import time
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


@dataclass
class Bouncer:
    """A running PgBouncer: the URIs through it (in the order of the ones it fronts), its pid."""

    uris: list[str]
    pid: int


def _pgbouncer_bin() -> str | None:
    """PgBouncer's binary: on PATH, else where Debian puts it (``/usr/sbin``, not on every
    user's PATH)."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None


def pgbouncer_available() -> str:
    """'' when PgBouncer can be started here, else why not."""
    if _pgbouncer_bin() is None:
        return "PgBouncer is not installed (apt-get install pgbouncer)"
    return ""


@contextmanager
def pgbouncer(uris: list[str], pool_size: int = 2) -> Iterator[Bouncer]:
    """PgBouncer in transaction mode in front of the databases of ``uris`` (URIs of one server,
    ``postgresql+psycopg2://USER@HOST:PORT/DB``, no password: the throwaway server trusts
    localhost), ``pool_size`` server connections per database: the pooler a job of many
    writers puts in front of its store. Stopped (by its pid) on exit."""
    exe = _pgbouncer_bin() or "pgbouncer"  # missing: Popen says so
    root = Path(tempfile.mkdtemp(prefix="rt-pgbouncer-"))
    port = _free_port()
    lines, fronted = ["[databases]"], []
    for uri in uris:
        head, name = uri.rsplit("/", 1)
        user, _, where = head.split("://", 1)[1].rpartition("@")
        host, db_port = where.rsplit(":", 1)
        lines.append(f"{name} = host={host} port={db_port} dbname={name} user={user}")
        fronted.append(f"{head.split('@', 1)[0]}@127.0.0.1:{port}/{name}")
    lines += ["[pgbouncer]", "listen_addr = 127.0.0.1", f"listen_port = {port}",
              "unix_socket_dir =", "auth_type = any", "pool_mode = transaction",
              f"default_pool_size = {pool_size}", "max_client_conn = 5000",
              f"logfile = {root / 'pgbouncer.log'}",
              "ignore_startup_parameters = extra_float_digits,options"]  # fmt: skip
    config = root / "pgbouncer.ini"
    config.write_text("\n".join(lines) + "\n")
    as_user: list[str] = []
    if os.geteuid() == 0:  # PgBouncer refuses root: it switches to PostgreSQL's user itself
        shutil.chown(root, "postgres")
        shutil.chown(config, "postgres")
        as_user = ["-u", "postgres"]
    proc = subprocess.Popen([exe, *as_user, str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:  # listening: then it serves
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = root / "pgbouncer.log"
                said = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"PgBouncer did not start: {said}")
            time.sleep(0.05)
        yield Bouncer(fronted, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
