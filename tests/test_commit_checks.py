"""No merge-conflict marker lands in the tree. docs/layout.md carried five of them for a round
and every doc test passed (#58): the markers are text that no other test reads as wrong.

The pre-commit hook ``check-merge-conflict`` (.pre-commit-config.yaml) stops them at commit
time; this test stops them in the suite, for a commit made without the hook.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# git's markers at the start of a line: 7 of <, =, > or | (diff3), then a space or the line's end;
# built from parts so that this file does not hold one
MARKER = re.compile("^(?:" + "|".join(re.escape(c * 7) for c in "<=>|") + ")(?: |$)", re.M)


def tracked_files() -> list[Path]:
    """The files git tracks (a fresh clone's tree); every file outside hidden and build folders
    when this is not a git checkout (an unpacked sdist)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout  # fmt: skip
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = ("build", "dist", "__pycache__")
        return [p for p in ROOT.rglob("*") if p.is_file() and not any(
            part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)]


def markers_in(text: str) -> list[int]:
    """Line numbers (1-based) of conflict markers in ``text``."""
    return [text.count("\n", 0, m.start()) + 1 for m in MARKER.finditer(text)]


def test_no_conflict_marker_in_the_tracked_tree() -> None:
    found = {}
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # images, and files deleted in the work tree but not yet in git's index
        if lines := markers_in(text):
            found[path.relative_to(ROOT).as_posix()] = lines
    assert found == {}, "merge-conflict markers (file: lines): resolve them"


def test_the_marker_check_can_fail() -> None:
    left, mid, right = "<" * 7, "=" * 7, ">" * 7
    text = f"a\n{left} HEAD\nours\n{mid}\ntheirs\n{right} branch\nb\n"
    assert markers_in(text) == [2, 4, 6]
    # a Markdown or reST underline is longer than seven; a marker mid-line is no marker
    assert markers_in("Title\n========\nx <<<<<<< y\n") == []
    assert any(p.name == "layout.md" for p in tracked_files())


def test_pre_commit_runs_offline_and_ci_runs_it() -> None:
    """docs/layout.md#checks-before-a-commit: every hook local (nothing cloned from GitHub, which
    CI cannot reach), each one's command installed by the test extra, and .ci/run runs them."""
    import shutil

    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    hooks = {hook["id"]: hook for hook in config["repos"][0]["hooks"]}
    assert {"check-merge-conflict", "check-added-large-files", "end-of-file-fixer", "ruff",
            "mypy"} <= set(hooks)  # fmt: skip
    assert "--assume-in-merge" in hooks["check-merge-conflict"]["args"]
    assert all(hook["language"] == "system" for hook in hooks.values())
    commands = {hook["entry"].split()[0] for hook in hooks.values()}
    assert [c for c in sorted(commands) if shutil.which(c) is None] == [], "pip install -e .[test]"
    test_extra = (ROOT / "pyproject.toml").read_text()
    assert '"pre-commit>=' in test_extra and '"pre-commit-hooks>=' in test_extra
    assert "\npre-commit run --all-files" in (ROOT / ".ci" / "run").read_text()
