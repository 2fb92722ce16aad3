"""The wheel holds everything the source tree does. Users (and CI, and verl's switch) install
rollout-tracer non-editable; a subpackage missing from pyproject's explicit `packages` list
imports fine from the checkout and fails only in site-packages (this happened: tracer.live)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# where each source folder lands in the wheel (pyproject's package-dir maps config/)
FOLDERS = {"tracer": "tracer", "rollout": "rollout", "config": "rollout/_config"}
NOT_SHIPPED = {"rollout_tracer_verl.pth"}  # the switch: at the wheel's top level, checked below


def source_files() -> set[str]:
    wanted = set()
    for folder, target in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            if path.name in NOT_SHIPPED:
                continue
            wanted.add(f"{target}/{path.relative_to(ROOT / folder).as_posix()}")
    return wanted


@pytest.mark.slow(seconds=15)
def test_the_wheel_holds_every_module_and_data_file(tmp_path: Path) -> None:
    # a copy of the tree: the build writes build/ and *.egg-info, never into the checkout
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "build", "*.egg-info", ".ci-logs", "tests",
        "benchmarks", "docs", ".*_cache", "mlruns", "traces", "runs", "out"))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    [wheel] = (tmp_path / "dist").glob("rollout_tracer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(source_files() - names)
    assert not missing, f"left out of the wheel (pyproject.toml [tool.setuptools]): {missing}"
    assert "rollout_tracer_verl.pth" in names  # setup.py puts verl's switch at the top level
