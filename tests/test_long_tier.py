"""The long tier (tests/conftest.py, #58): a test marked ``long`` is skipped by README command 2,
saying how to run it, runs when its file is named or with ``--long``, and CI runs the tier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = "from tests.conftest import pytest_addoption, pytest_collection_modifyitems  # noqa\n"
TESTS = """\
import pytest

@pytest.mark.long
def test_whole_job():
    pass

def test_quick():
    pass
"""


def _pytest(folder: Path, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-c", os.devnull, "--rootdir", str(folder),
                          "-W", "ignore::pytest.PytestUnknownMarkWarning", *args], cwd=folder,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_a_long_test_runs_only_when_asked_or_named(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_tier.py").write_text(TESTS)
    out = _pytest(tmp_path, ".")  # a folder, as README command 2's `tests`
    assert "1 passed, 1 skipped" in out
    assert "long (a whole job): python -m pytest --long -m long" in out
    assert "2 passed" in _pytest(tmp_path, "test_tier.py")  # its file named: it runs
    assert "2 passed" in _pytest(tmp_path, ".", "--long")
    assert "1 passed, 1 deselected" in _pytest(tmp_path, ".", "--long", "-m", "long")


def test_ci_runs_the_long_tier_after_the_suite() -> None:
    steps = (ROOT / ".ci" / "run").read_text().splitlines()
    suite = steps.index("python -m pytest")
    assert "python -m pytest --long -m long" in steps[suite + 1 :]
