"""Servers the backend tests run against: a real lean ``mlflow server`` in its own process group,
and an in-process Weave trace server.

The Weave cloud cannot be reached from the test machines (and weave ships no local server), so
:class:`InProcessWeaveServer` implements the part of weave's trace-server interface that the
real ``WeaveClient`` uses to write calls, and keeps every request it receives for assertions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports. Each socket stays bound until all are chosen: one at a time,
    the kernel may hand the same port out twice (a Ray node once got one port for two of its
    components and exited)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def closed_port_url() -> str:
    """An OTLP endpoint on 127.0.0.1 where nothing listens (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}/v1/traces"


class MlflowServer:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.url = url
        self.proc = proc
        self.log_path = log_path

    def experiment_id(self, name: str) -> str:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.url)
        exp = client.get_experiment_by_name(name)
        return str(exp.experiment_id) if exp is not None else str(client.create_experiment(name))

    def stop(self, kill: bool = False) -> None:
        """Stop the server's process group; ``kill`` sends SIGKILL at once (a crash)."""
        if kill and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        _stop_group(self.proc)


def _mlflow_executable() -> str:
    exe = Path(sys.executable).with_name("mlflow")
    return str(exe) if exe.exists() else (shutil.which("mlflow") or "mlflow")


def start_mlflow_server(
    root: Path,
    port: int | None = None,
    backend_store_uri: str | None = None,
    workers: int = 1,
    host: str = "127.0.0.1",
) -> MlflowServer:
    """Start a lean ``mlflow server`` (``workers`` workers, no job execution) on ``host`` over
    ``backend_store_uri`` (default: the sqlite store in ``root``), in its own process group,
    and wait until it is healthy."""
    port = port or free_port()
    log_path = root / "server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        _mlflow_executable(),
        "server",
        "--backend-store-uri",
        backend_store_uri or f"sqlite:///{root / 'mlflow.db'}",
        "--default-artifact-root",
        str(root / "artifacts"),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {log_path.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy: {log_path.read_text()[-3000:]}")
            time.sleep(0.25)
    except BaseException:
        _stop_group(proc)
        raise
    return MlflowServer(url, proc, log_path)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A lean ``mlflow server`` shared by the session; stopped at the end."""
    pytest.importorskip("mlflow")
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop(kill=True)  # its data goes with the session: no graceful shutdown to wait for


@pytest.fixture(scope="session")
def postgres_uri() -> Iterator[str]:
    """A throwaway PostgreSQL server (initdb in a temporary folder, stopped at the end) and the
    SQLAlchemy URI of an empty database on it; skips, saying why, where it cannot start."""
    from benchmarks.postgres import postgres_available, temporary_postgres

    if why := postgres_available():
        pytest.skip(why)
    with temporary_postgres("mlflow") as uris:
        yield uris[0]


@pytest.fixture(scope="session")
def postgres_mlflow_server(
    postgres_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MlflowServer]:
    """A lean ``mlflow server`` on the session's PostgreSQL (``postgresql+psycopg2://``);
    stopped at the end. (Ray nodes on 127.0.0.2/.3 reach 127.0.0.1: all of it is loopback.)"""
    pytest.importorskip("mlflow")
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-pg"),
                                 backend_store_uri=postgres_uri)  # fmt: skip
    try:
        yield server
    finally:
        server.stop(kill=True)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the process group we started (its pgid is the server's pid: start_new_session)."""
    if proc.poll() is not None:
        return
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=5)


def _digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()


class InProcessWeaveServer:
    """Stands in for the Weave cloud (unreachable here): implements the trace-server methods
    the real ``WeaveClient`` calls to write calls, objects, files and tables, and to query
    calls back. Deliberately no catch-all ``__getattr__`` (it would make the client think this
    server has a ``call_processor`` and break flushing)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: list[dict[str, Any]] = []
        self.ends: list[dict[str, Any]] = []
        self.objs: list[dict[str, Any]] = []
        self.files: dict[str, bytes] = {}
        self.tables: dict[str, list[Any]] = {}
        self.feedback: dict[str, dict[str, Any]] = {}

    # writes ---------------------------------------------------------------------------
    def call_start(self, req: Any) -> Any:
        from weave.vendor.weave_server_sdk.types import CallStartResponse

        start = dict(req["start"])
        with self.lock:
            self.starts.append(start)
        return CallStartResponse(id=start["id"], trace_id=start["trace_id"])

    def call_end(self, req: Any) -> Any:
        with self.lock:
            self.ends.append(dict(req["end"]))
        return {}

    def obj_create(self, req: Any) -> Any:
        from weave.vendor.weave_server_sdk.types import ObjectCreateResponse

        obj = dict(req["obj"])
        digest = obj.get("expected_digest") or _digest(obj["val"])
        with self.lock:
            self.objs.append(obj)
        return ObjectCreateResponse(digest=digest, object_id=obj["object_id"])

    def file_create(self, req: Any) -> Any:
        from weave.vendor.weave_server_sdk.types import FileCreateResponse

        content = req.get("file")
        if isinstance(content, tuple):  # (name, bytes[, content type])
            content = content[1]
        if hasattr(content, "read"):
            content = content.read()
        data = content if isinstance(content, bytes) else str(content).encode()
        digest = req.get("expected_digest") or hashlib.sha256(data).hexdigest()
        with self.lock:
            self.files[digest] = data
        return FileCreateResponse(digest=digest)

    def feedback_create(self, req: Any) -> Any:
        """Stored by id (a client-given id replaces the row, as an upsert)."""
        import datetime

        from weave.vendor.weave_server_sdk.types import FeedbackCreateResponse

        row = {k: v for k, v in dict(req).items() if v is not None}
        row.setdefault("id", str(uuid.uuid4()))
        row["created_at"] = datetime.datetime.now(datetime.timezone.utc)
        with self.lock:
            self.feedback[row["id"]] = row
        return FeedbackCreateResponse(id=row["id"], created_at=row["created_at"],
                                      payload=row["payload"], wb_user_id="tests")  # fmt: skip

    def feedback_query(self, req: Any) -> Any:
        """Only the query weave's ``call.feedback`` sends: ``weave_ref`` equal to a literal."""
        from weave.vendor.weave_server_sdk.types import FeedbackQueryResponse

        field, literal = req["query"]["$expr"]["$eq"]
        if field != {"$getField": "weave_ref"}:
            raise NotImplementedError(f"InProcessWeaveServer: feedback query {req['query']}")
        with self.lock:
            rows = [dict(r) for r in self.feedback.values()
                    if r["project_id"] == req["project_id"]
                    and r["weave_ref"] == literal["$literal"]]  # fmt: skip
        return FeedbackQueryResponse(result=rows, total_count=len(rows))

    def table_create(self, req: Any) -> Any:
        from weave.vendor.weave_server_sdk.types import TableCreateResponse

        rows = list(req["table"]["rows"])
        digest = _digest(rows)
        with self.lock:
            self.tables[digest] = rows
        return TableCreateResponse(digest=digest, row_digests=[_digest(r) for r in rows])

    # reads ----------------------------------------------------------------------------
    def calls(self) -> list[dict[str, Any]]:
        """Every call as start fields merged with its end fields, in start order."""
        with self.lock:
            ends = {e["id"]: e for e in self.ends}
            out = []
            for start in self.starts:
                end = ends.get(start["id"], {})
                out.append(
                    {
                        **start,
                        "ended_at": end.get("ended_at"),
                        "output": end.get("output"),
                        "summary": end.get("summary"),
                        "exception": end.get("exception"),
                    }
                )
            return out

    def calls_query_stream(self, req: Any) -> Iterator[Any]:
        """Like the real server: the project's calls matching ``filter`` (``call_ids``,
        ``trace_ids``, ``parent_ids``, ``trace_roots_only``), ordered by ``sort_by`` (else start
        order), then ``offset`` / ``limit``; ``columns`` keeps those fields plus the ones always
        returned. ``query`` expressions are not implemented (an error, not a silent no-op)."""
        from weave.vendor.weave_server_sdk.types.call_read_response import Call

        if req.get("query"):
            raise NotImplementedError("InProcessWeaveServer: calls query expressions")
        flt = req.get("filter") or {}
        calls = [
            Call.model_validate({k: v for k, v in call.items() if k in Call.model_fields})
            for call in self.calls()
            if call["project_id"] == req["project_id"]
        ]
        for key, field in (("call_ids", "id"), ("trace_ids", "trace_id"),
                           ("parent_ids", "parent_id")):  # fmt: skip
            if flt.get(key) is not None:
                wanted = set(flt[key])
                calls = [c for c in calls if getattr(c, field) in wanted]
        if flt.get("trace_roots_only"):
            calls = [c for c in calls if c.parent_id is None]
        for sort in reversed(req.get("sort_by") or []):  # stable sorts: last key first
            field = sort["field"]
            calls.sort(key=lambda c: (getattr(c, field) is None, getattr(c, field) or 0),
                       reverse=sort["direction"] == "desc")  # fmt: skip
        offset = req.get("offset") or 0
        limit = req.get("limit")
        calls = calls[offset : None if limit is None else offset + limit]
        columns = req.get("columns")
        for call in calls:
            if columns:
                keep = {"id", "project_id", "trace_id", "op_name", "started_at"}
                keep |= {c.split(".", 1)[0] for c in columns}
                fields = call.model_dump()
                call = Call.model_validate(
                    {k: v if k in keep else ({} if k in ("inputs", "attributes") else None)
                     for k, v in fields.items()}
                )  # fmt: skip
            yield call

    def calls_query_stats(self, req: Any) -> Any:
        from weave.vendor.weave_server_sdk.types import CallQueryStatsResponse

        return CallQueryStatsResponse(count=len(self.starts))
