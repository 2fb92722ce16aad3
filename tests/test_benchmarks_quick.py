"""The benchmark suite's quick mode runs end to end and writes every section with numbers.

No timing assertions: the machine is shared; only the shape of the report is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mlflow")
pytest.importorskip("opentelemetry.sdk")

# The quick run in three parts, one subprocess each, so that pytest-xdist runs them side by side
# (one run was 144 s on 2 quiet cores). Each part: its sections (`--sections`), the headings
# they write, and how many targets with a goal ("met"/"MISSED") they set.
PARTS = {
    "hotpath,memory,cpu,readers,otlp_attrs": (
        ("## 1. Hot path", "## 4. Peak memory", "## 9. Whole-process CPU per durable trajectory",
         "## 6. Reader commands", "## 7. OTLP attributes per trajectory"), 6),
    "e2e": (("## 2. End to end",), 2),
    "throughput,export": (("## 3. Rollout throughput", "## 5. Export to Parquet"), 2),
}  # fmt: skip


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start : nxt if nxt != -1 else len(text)]


# Each part costs 19-27 CPU-seconds alone (68 for the three, 102 before the quick sizes of
# 2026-12-06: `/usr/bin/time python -m benchmarks.run --quick --sections ...`, both taken
# back to back at load 1-3): the benchmarks' own quick runs, real stores and the peers they
# are measured against. e2e's quick run starts an mlflow server and one spawned MLflow writer (its
# PostgreSQL leg runs only in the full benchmark); throughput generates with SmolLM2 on CPU.
@pytest.mark.slow(seconds=70)
@pytest.mark.long
@pytest.mark.parametrize("sections", list(PARTS))
def test_quick_benchmarks_write_every_section(tmp_path: Path, sections: str) -> None:
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--sections", sections,
         "--output", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    headings, goals = PARTS[sections]
    for heading in ("## Machine", "## Targets", *headings):
        assert heading in text, f"missing {heading!r}"
        body = _section(text, heading)
        assert "Section failed" not in body and not re.search("^failed:", body, re.M), body
        assert re.search(r"\d+\.\d+", body), f"no numbers in {heading!r}"
    targets = _section(text, "## Targets")
    assert targets.count("| **") >= goals, targets  # each target with a goal: met or MISSED
    if "hotpath" in sections:
        _check_hot_path(text)
    if "e2e" in sections:
        _check_end_to_end(text)
    if "throughput" in sections:
        _check_throughput_and_export(text)


def _check_hot_path(text: str) -> None:
    hot = _section(text, "## 1. Hot path")
    for label in ("bare function call", "unsampled trajectory", "our op, sampled trajectory",
                  "OpenTelemetry SDK span", "mlflow.start_span", "verl-style"):  # fmt: skip
        rows = [line for line in hot.splitlines() if line.startswith("| ") and label in line]
        row = rows[0] if rows else None
        assert row is not None and re.search(r"\| \d+\.\d+ \|", row), f"no figure for {label!r}"
    mem = _section(text, "## 4. Peak memory")
    assert re.search(r"peak RSS \| [\d.]+ MiB", mem)
    held = r"held \(memory \+ spool\) / of those in the spool / dropped \| \d+ / \d+ / \d+"
    assert re.search(held, mem)
    cpu = _section(text, "## 9. Whole-process CPU per durable trajectory")
    assert re.search(r"\| OpenTelemetry SDK .+ \| [\d.]+ \|", cpu), cpu
    assert re.search(r"\| serialize \| [\d.]+ \|", cpu), cpu


def _check_end_to_end(text: str) -> None:
    e2e = _section(text, "## 2. End to end")
    ours = r"rollout-tracer \(mlflow backend, .+?\) \| [\d.]+ \| [\d.]+"
    assert re.search(ours + r" \| \d+/\d+", e2e)
    # the same two paths through a real tracking server, each with its ratio per durable trace
    server = e2e[e2e.index("through a real tracking server") :]
    assert re.search(ours + r" \| \d+/\d+", server), server
    assert re.search(r"Per durable trace: ours [\d.]+ ms, MLflow fluent [\d.]+ ms", server)
    assert re.search(r"MLflow fluent `start_span` \| [\d.]+ \| [\d.]+ \| \d+/\d+", e2e)


def _check_throughput_and_export(text: str) -> None:
    tp = _section(text, "## 3. Rollout throughput")
    for mode in ("off", "on_100pct", "sampled_n4"):
        assert re.search(rf"\| {mode} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", tp), mode
    export = _section(text, "## 5. Export to Parquet")
    assert re.search(r"\| jsonl \| 200 \| \d+ \| [\d.]+ \|", export), export
