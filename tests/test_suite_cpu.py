"""scripts/suite_cpu.py, the plugin #58's per-test CPU figures come from, run as its docstring
says on a suite of two tests: one that spins in the test's process, one whose child spins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = """\
import subprocess, sys

def test_spins():
    x = 0
    for i in range(3_000_000):
        x += i

def test_child_spins():
    subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(3_000_000): x += i"], check=True)
"""


def test_each_test_gets_its_own_and_its_childrens_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_spin.py").write_text(TESTS)
    out = tmp_path / "cpu.jsonl"
    env = {**os.environ, "SUITE_CPU_OUT": str(out), "SUITE_CPU_EVERY": "0.2",
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "scripts.suite_cpu", "-q",
                          "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path),
                          "test_spin.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rows = {r["id"]: r for r in lines if "id" in r}
    assert set(rows) == {"test_spin.py::test_spins", "test_spin.py::test_child_spins"}
    spins, child = rows["test_spin.py::test_spins"], rows["test_spin.py::test_child_spins"]
    assert spins["self"] > 5 * spins["children"] and spins["self"] > 0.05
    assert child["children"] > 5 * child["self"] and child["children"] > 0.05
    # the timeline: the second test began after the first one ended (one process, in order)
    first, second = sorted((spins, child), key=lambda r: r["start"])
    assert second["start"] >= first["start"] + first["wall"] - 0.01
    summary = subprocess.run([sys.executable, str(ROOT / "scripts" / "suite_cpu.py"), str(out)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert summary.startswith("2 tests, ") and "test_spin.py" in summary.splitlines()[-1]
    # the machine, sampled by the session's process every 0.2 s and once at its end: the
    # spinning parts of the run show as busy time, and the timeline names the file running
    machine = [r for r in lines if "machine" in r]
    assert machine and sum(r["busy"] for r in machine) > 0
    assert all(0 <= r["busy"] <= r["total"] for r in machine)
    timeline = subprocess.run([sys.executable, str(ROOT / "scripts" / "suite_cpu.py"), str(out),
                               "--timeline", "60"], capture_output=True, text=True,
                              check=True).stdout.splitlines()  # fmt: skip
    assert timeline[0].startswith("the machine's busy %") and "test_spin.py" in timeline[1]
