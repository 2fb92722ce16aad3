"""A running explorer over HTTP, for the benchmarks that time it (``benchmarks/explore.py``,
``benchmarks/bench_patterns.py``): start ``rollout-tracer explore`` in its own process, GET its
JSON API with the time each call took, and percentiles of those times. Its own module so that
neither benchmark imports the other (``tests/test_layout.py`` fails on an import cycle in
``benchmarks/``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def get(base: str, path: str, params: list[tuple[str, Any]] | None = None) -> tuple[float, Any]:
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as r:
        body = json.loads(r.read())
    return time.perf_counter() - t0, body


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def start(args: list[str]) -> tuple[subprocess.Popen[str], str, float]:
    """Start ``rollout-tracer explore``; return it, its base URL and seconds until /api/list
    answered."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "explore", "--port", "0",
                             "--no-progress", *args], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip
    assert proc.stdout is not None
    seen = []
    while "http://" not in (line := proc.stdout.readline()):
        seen.append(line)
        if not line:
            proc.kill()
            raise RuntimeError("explore did not start: " + "".join(seen))
    base = "http://" + line.split("http://", 1)[1].split("/", 1)[0] + "/"
    get(base, "api/list", [("size", 50)])
    return proc, base, time.perf_counter() - t0
