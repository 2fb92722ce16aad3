"""A real two-node Ray cluster on one machine, started and stopped by the tests themselves.

Each node is ``ray start --block`` in its own process group (so it and everything it starts can
be stopped by that group, never by ``ray stop``, which would stop every Ray on the machine),
with one CPU, a custom resource naming it, loopback addresses of its own (Ray would rewrite
127.0.0.1: ``--node-ip-address=127.0.0.2`` / ``127.0.0.3``), one private ``--temp-dir``, token
authentication with a token made here, and free ports for everything Ray would otherwise take
at a fixed default (other Ray clusters may run on the same machine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests._servers import free_ports

ROOT = Path(__file__).resolve().parent.parent
NODE_IPS = {"head": "127.0.0.2", "worker": "127.0.0.3"}
# the ports each node is given (Ray would otherwise pick fixed or random ones of its own)
_NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")


def ray_available() -> str:
    """'' when a local two-node cluster can be started here, else why not."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'rollout-tracer[ray]')"
    if not Path(sys.executable).with_name("ray").exists() and not shutil.which("ray"):
        return "the `ray` command is not installed next to this Python"
    return ""


def _ray_exe() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


class RayCluster:
    """``head`` (127.0.0.2) and ``worker`` (127.0.0.3), each with resource ``node_<name>``.

    ``env()`` is what a driver needs to join (``RAY_ADDRESS``, the token); ``kill_raylet``
    SIGKILLs one node's raylet (a node failure); ``stop`` ends every process the cluster
    started, by process group.
    """

    def __init__(self, start_timeout_s: float = 240.0, wait: bool = True) -> None:
        # a short root: Ray's socket paths live under it and must stay under 108 bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rtray-", dir="/tmp"))
        self.token = secrets.token_hex(16)
        # every port of both nodes at once, all distinct
        self.port, *rest = free_ports(1 + 2 * len(_NODE_PORTS))
        self.node_ports = {"head": rest[: len(_NODE_PORTS)], "worker": rest[len(_NODE_PORTS):]}
        self.address = f"{NODE_IPS['head']}:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.start_timeout_s = start_timeout_s
        try:
            self._start("head")
            # the worker node starts as soon as the head's GCS listens (it registers once the
            # head is up), so both start together; one probe then waits for both
            self._wait_for_port(NODE_IPS["head"], self.port)
            self._start("worker")
            self._up = False
            if wait:
                self.wait_until_up()
        except BaseException:
            self.stop()
            raise

    def wait_until_up(self) -> None:
        """Until both nodes are alive (``wait=False`` leaves this to the first ``env()``,
        ``drive()`` or ``raylet_pid()``: the nodes start while the test's other setup runs)."""
        if not self._up:
            try:
                self.wait_for_nodes(2)
            except BaseException:
                self.stop()
                raise
            self._up = True

    def env(self) -> dict[str, str]:
        """The environment of a driver that joins this cluster (once both nodes are up)."""
        self.wait_until_up()
        return self._env()

    def _env(self) -> dict[str, str]:
        """The environment of a driver or a node (no waiting: the nodes' own start uses it)."""
        return {
            **os.environ,
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            # node failure noticed in ~2 s instead of Ray's ~30 s default
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            # no MLflow export child in the actors unless asked for outside (tests/conftest.py):
            # the nodes start before any test's own setting, and their workers inherit this
            "ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS": os.environ.get(
                "ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS", "false"),
            # the workers import this checkout, installed or not
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }

    def drive(self, scenario: str, **args: Any) -> dict[str, Any]:
        """Run a scenario of tests/_multinode_driver.py in its own driver process on this
        cluster (Ray reads its auth mode once per process: pytest's never joins); its result."""
        proc = subprocess.run([sys.executable, "-m", "tests._multinode_driver", scenario,
                               json.dumps(args)], env=self.env(), capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
        return dict(json.loads(lines[-1][len("RESULT "):]))

    def _start(self, name: str) -> None:
        ip = NODE_IPS[name]
        ports: dict[str, int] = dict(zip(_NODE_PORTS, self.node_ports[name], strict=True))
        ports.update({"--min-worker-port": 0, "--max-worker-port": 0})
        cmd = [_ray_exe(), "start", "--block", "--num-cpus=1", "--num-gpus=0",
               f"--resources={{\"node_{name}\": 1}}", f"--node-ip-address={ip}",
               "--object-store-memory=100000000", "--disable-usage-stats",
               *(f"{k}={v}" for k, v in ports.items())]  # fmt: skip
        if name == "head":
            cmd += [f"--port={self.port}", "--head", "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}"]  # fmt: skip
        else:
            cmd += [f"--address={self.address}"]
        log = open(self.temp_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        env = {k: v for k, v in self._env().items() if k != "RAY_ADDRESS"}
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # fmt: skip
        log.close()

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.temp_dir.glob("*.log")))  # fmt: skip

    def _wait_for_port(self, host: str, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"ray node {name} exited:\n{self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray head not listening on {host}:{port} in "
                                   f"{self.start_timeout_s:.0f} s:\n{self.log_tail()}")  # fmt: skip
            time.sleep(0.1)

    def wait_for_nodes(self, count: int) -> None:
        """Until ``count`` nodes are alive (asked through a short-lived driver subprocess, so
        this process never joins the cluster)."""
        probe = ("import ray; ray.init(); "
                 "print(sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()")  # fmt: skip
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"ray node {name} exited:\n{self.log_tail()}")
            with contextlib.suppress(subprocess.SubprocessError):
                out = subprocess.run([sys.executable, "-c", probe], env=self._env(), timeout=120,
                                     capture_output=True, text=True)  # fmt: skip
                lines = out.stdout.strip().splitlines()
                if out.returncode == 0 and lines and int(lines[-1]) >= count:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} ray nodes not up in {self.start_timeout_s:.0f} s:"
                                   f"\n{self.log_tail()}")  # fmt: skip
            time.sleep(1)

    def _group_pids(self, name: str) -> list[int]:
        pgid = self.procs[name].pid
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getpgid(int(entry.name)) == pgid:
                        pids.append(int(entry.name))
        return pids

    def raylet_pid(self, name: str) -> int:
        """The pid of node ``name``'s raylet (in that node's process group)."""
        self.wait_until_up()
        for pid in self._group_pids(name):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
        raise RuntimeError(f"no raylet in node {name}'s process group")

    def kill_raylet(self, name: str) -> int:
        """SIGKILL node ``name``'s raylet, as a node failure does; its pid."""
        pid = self.raylet_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        """End every process each node started (its process group), then the temp dir.

        SIGKILL at once: the cluster and its data are throwaway, and a graceful `ray start`
        exit took ~5 s of waiting per node; the group also takes the workers the raylet
        started, which may outlive `ray start`."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# The worker's cluster: started by the first test that asks for it, stopped after the last
# one (tests/conftest.py) or at the end of the session. An idle two-node cluster costs ~4.5 s
# of CPU a minute (measured: its processes' CPU over 60 s idle); the Ray tests run first on
# the "servers" worker, so it would sit idle for most of the suite.
_shared: RayCluster | None = None


@pytest.fixture
def ray_cluster() -> RayCluster:
    """The two-node Ray cluster the tests share (head 127.0.0.2, worker 127.0.0.3); skips,
    saying why, where Ray is missing."""
    global _shared
    if why := ray_available():
        pytest.skip(why)
    if _shared is None:
        _shared = RayCluster(wait=False)  # its nodes start while the test's own setup runs
    return _shared


def stop_shared_cluster() -> None:
    """Stop the shared cluster, if one runs (a later test that asks starts a new one)."""
    global _shared
    cluster, _shared = _shared, None
    if cluster is not None:
        cluster.stop()
