"""Shared helpers: timing loops, machine facts, package versions, section subprocesses."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "mlflow",
    "opentelemetry-sdk",
    "weave",
    "torch",
    "transformers",
    "vllm",
    "psutil",
)

# MLflow's telemetry is not what we measure.
QUIET_ENV = {
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "TOKENIZERS_PARALLELISM": "false",
}


def quiet_env() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def per_call_us(
    fn: Callable[[int], None],
    n: int,
    repeats: int,
    between: Callable[[], None] | None = None,
) -> list[float]:
    """``fn(n)`` runs ``n`` calls; returns µs per call for each repeat (GC off while timed).
    ``between`` runs untimed after each repeat (flush the background exporters there)."""
    out = []
    for _ in range(repeats):
        if between is not None:
            between()
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn(n)
            dt = time.perf_counter() - t0
        finally:
            gc.enable()
        out.append(dt / n * 1e6)
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": _mem_gib(),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        versions["rollout-tracer"] = metadata.version("rollout-tracer")
    except metadata.PackageNotFoundError:
        versions["rollout-tracer"] = "source"
    info["versions"] = versions
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "tracer", "rollout"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        info["commit"] = commit + (
            " (+ uncommitted changes in tracer/ or rollout/)" if dirty else ""
        )
    except OSError:
        info["commit"] = None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _status_mib(field: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mib() -> float:
    """Peak RSS of this process image (VmHWM; ru_maxrss would carry the parent's peak across
    fork+exec)."""
    return _status_mib("VmHWM:")


def current_rss_mib() -> float:
    return _status_mib("VmRSS:")


def run_section(module: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> --json FILE ARGS`` in a fresh interpreter (MLflow's
    and the tracer's process-global state, and peak RSS, stay per section)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", f"benchmarks.{module}", "--json", str(out), *args]
        env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            return {"error": f"exit {proc.returncode}: {tail}"}
        result: dict[str, Any] = json.loads(out.read_text())
        result["section_wall_s"] = round(wall, 1)
        return result


def section_main(run: Callable[[bool], dict[str, Any]]) -> None:
    """Entry point of a section module: ``--json FILE [--quick]``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    quiet_env()
    result = run(a.quick)
    Path(a.json).write_text(json.dumps(result, indent=1, default=str))


_TEMPLATE_ENV = "BENCH_MLFLOW_TEMPLATE"


def share_store_template(directory: str | Path) -> None:
    """Name one template file in ``directory`` for this process and the sections it starts
    (they inherit the variable): the first :func:`mlflow_store` makes it, the others copy
    it. Nothing is made here: a run whose sections need no store never imports MLflow."""
    os.environ[_TEMPLATE_ENV] = str(Path(directory) / "template-mlflow.db")


def mlflow_store(directory: str | Path, name: str = "mlflow.db") -> str:
    """A fresh, empty MLflow sqlite store in ``directory``. Creating one runs MLflow's schema
    migrations (about 1 CPU-s), so the first one is kept as a template and copied afterwards:
    at ``$BENCH_MLFLOW_TEMPLATE`` when set (:func:`share_store_template`), else beside it."""
    import shutil

    target = Path(directory) / name
    template = os.environ.get(_TEMPLATE_ENV) or str(Path(directory) / f".template-{name}")
    if not Path(template).exists():
        from mlflow.tracking import MlflowClient

        partial = f"{template}.{os.getpid()}.partial"  # a section that dies leaves no half
        MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()
        os.replace(partial, template)
        os.environ[_TEMPLATE_ENV] = template
    shutil.copyfile(template, target)
    return f"sqlite:///{target}"


def count_traces(uri: str, experiment: str) -> int:
    """Traces stored in ``experiment``, read back with MLflow's own client, every page."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return 0
    total, token = 0, None
    while True:
        page = client.search_traces(
            locations=[exp.experiment_id], max_results=500, page_token=token
        )
        total += len(page)
        token = page.token
        if not token:
            return total
