"""``rollout-tracer ui``: the MLflow trace UI on the store a run wrote to.

Starts a lean ``mlflow server`` (one worker, no job execution, 127.0.0.1) over the tracking
store the tracer used (``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``./mlflow.db``:
the same resolution as the tracer's MLflow backend), waits until ``/health`` answers, prints
the URL of the experiment's Traces tab and runs until Ctrl-C or SIGTERM, then stops the server's
whole process group. When the URI already names a tracking server (http/https), nothing is
started: the URL is printed and the command returns.

A reader: it depends only on stored data, never on the tracer's hot path.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

HEALTH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


def configure_ui(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        help="MLflow store the run wrote to (default: MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    p.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default 5000)")
    p.add_argument(
        "--experiment",
        help="MLflow experiment to open (the tracer's project_name; default rollout-tracer)",
    )
    p.add_argument(
        "--artifacts",
        help="artifact root for the server (default: a temporary folder; traces need none)",
    )


def resolve_tracking_uri(uri: str | None) -> str:
    """The tracer's resolution (tracer.backends.mlflow_backend.resolve_tracking_uri)."""
    from tracer.backends.mlflow_backend import resolve_tracking_uri as resolve
    from tracer.config import TraceConfig

    return resolve(TraceConfig(backend=None, tracking_uri=uri))


def traces_url(base: str, experiment_id: str | None) -> str:
    """The Traces tab of an experiment (the experiments list when it is unknown)."""
    base = base.rstrip("/")
    if experiment_id is None:
        return f"{base}/#/experiments"
    return f"{base}/#/experiments/{experiment_id}/traces"


def experiment_id(tracking_uri: str, name: str) -> str | None:
    """Id of experiment ``name`` in the store, or None when it does not exist (yet)."""
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name(name)
    return None if exp is None else str(exp.experiment_id)


def _mlflow_executable() -> str:
    exe = Path(sys.executable).with_name("mlflow")
    return str(exe) if exe.exists() else (shutil.which("mlflow") or "mlflow")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_server(tracking_uri: str, port: int, artifacts: str) -> subprocess.Popen[bytes]:
    """A lean ``mlflow server`` on 127.0.0.1:``port`` in its own process group."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        _mlflow_executable(), "server",
        "--backend-store-uri", tracking_uri,
        "--default-artifact-root", artifacts,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> bool:
    """True once ``url``/health answers 200; False if the server exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{url}/health", timeout=2) as resp,
        ):
            if resp.status == 200:
                return True
        time.sleep(0.25)
    return False


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (its pgid is its pid), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _print_hint(url: str, experiment: str, exp_id: str | None) -> None:
    print(f"MLflow trace UI: {url}", flush=True)
    if exp_id is None:
        print(f"  (experiment {experiment!r} not found in this store; listing all experiments)")
    print("  filter a step: Filters > Tag, key step, value 2 (search filter: tags.step = '2');")
    print("  the reward is the 'reward' column; open a trace for its turns and tool calls")


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the MLflow UI over the run's store until interrupted."""
    # the UI is MLflow's server: without MLflow, one line and exit 2 (rollout/extras.py)
    import mlflow  # noqa: F401

    uri = resolve_tracking_uri(args.tracking_uri)
    experiment = args.experiment or "rollout-tracer"
    if uri.startswith(("http://", "https://")):  # already a server: nothing to start
        exp_id = _quiet_experiment_id(uri, experiment)
        _print_hint(traces_url(uri, exp_id), experiment, exp_id)
        return 0
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///") :])
        if not path.exists():
            print(f"rollout-tracer: error: no MLflow store at {path}", file=sys.stderr)
            return 2
    if not _port_free(args.port):
        print(f"rollout-tracer: error: port {args.port} is in use (--port)", file=sys.stderr)
        return 2
    exp_id = _quiet_experiment_id(uri, experiment)
    base = f"http://127.0.0.1:{args.port}"
    with contextlib.ExitStack() as stack:
        artifacts = args.artifacts or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="rollout-tracer-ui-")
        )
        print(f"starting mlflow server on {base} for {uri} ...", flush=True)
        return _serve(uri, args.port, artifacts, base, experiment, exp_id)


def _serve(
    uri: str, port: int, artifacts: str, base: str, experiment: str, exp_id: str | None
) -> int:
    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGINT too, not only SIGTERM: a process started as a background job of a script (`cmd &`,
    # how a long test run or a CI step is often started) inherits SIGINT *ignored*, and Python
    # then never installs its KeyboardInterrupt handler, so "press Ctrl-C" (kill -INT) did
    # nothing. This is the command's own process, like `mlflow server` and uvicorn, which also
    # handle both signals whatever they inherited.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    proc = start_server(uri, port, artifacts)
    try:
        if not wait_healthy(proc, base, HEALTH_TIMEOUT_S):
            print("rollout-tracer: error: mlflow server did not become healthy", file=sys.stderr)
            return 1
        _print_hint(traces_url(base, exp_id), experiment, exp_id)
        print("press Ctrl-C to stop", flush=True)
        while proc.poll() is None:
            time.sleep(0.5)
        print(f"rollout-tracer: mlflow server exited ({proc.returncode})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_server(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("mlflow server stopped", flush=True)


def _quiet_experiment_id(uri: str, name: str) -> str | None:
    try:
        return experiment_id(uri, name)
    except Exception as exc:  # unreadable store: still serve it, the UI shows the error
        print(f"rollout-tracer: warning: cannot read experiments ({exc})", file=sys.stderr)
        return None
