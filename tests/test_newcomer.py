"""A newcomer's path: following only the README's first screen (its first 60 lines), a fresh venv
gets to a traced run and a browsable UI.

What is tested where, and why this way. A fresh venv costs ~3 minutes of installs on 2 cores;
the suite cannot afford one per run, and a venv made with `--system-site-packages` would not be
fresh. So the path is checked in two halves that meet:
- the install (here): the first screen's commands are, step for step, the ones `.ci/run`
  executes in a fresh venv (`.venv-ci`) on every landing;
- the run and the UI (tests/test_main_job.py, which runs the main job once for both): the
  first screen's run command in an empty folder, in this test's environment (the packages
  those installs put there), then the UI command it names, serving that run's traces.
"""

from __future__ import annotations

import re
import shlex

from tests._markdown import ROOT, first_screen, first_screen_commands


def ci_steps() -> list[list[str]]:
    """What .ci/run does in its fresh venv, in order: the venv, the installs, the tests (its
    first pytest step: the long tier after it is not README command 2's)."""
    steps = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a line shlex cannot read is no install step
            continue
        if words[:3] == ["python3", "-m", "venv"]:
            steps.append(["python3", "-m", "venv", ".venv"])  # CI names it .venv-ci
        elif words[:2] == ["quiet_pip", "install"] and "--upgrade" not in words:
            steps.append(["pip", "install", *[w for w in words[2:] if w != "-q"]])
        elif words[:3] == ["python", "-m", "pytest"]:
            steps.append(words)
            return steps
    return steps


def test_the_first_screen_has_the_whole_path() -> None:
    text = first_screen()
    assert re.search(r"^!\[[^\]]+\]\([^)]+\.png\)", text, re.M), "the picture"
    lines = first_screen_commands()
    main_job = [steps for steps in lines if steps[-1] == ["rollout-tracer", "run"]]
    tests = [steps for steps in lines if steps[-1][:3] == ["python", "-m", "pytest"]]
    ui = [steps for steps in lines if steps[0][:2] == ["rollout-tracer", "ui"]]
    assert len(main_job) == 1 and len(tests) == 1 and len(ui) == 1, lines


def test_the_first_screen_installs_are_what_ci_runs_in_a_fresh_venv() -> None:
    lines = first_screen_commands()
    [tests] = [s for s in lines if s[-1][:3] == ["python", "-m", "pytest"]]
    [main_job] = [s for s in lines if s[-1] == ["rollout-tracer", "run"]]
    drop_activate = [s for s in tests if s[:1] != ["."]]
    assert drop_activate == ci_steps(), "README command 2 and .ci/run's venv differ"
    # the main job installs the same packages but the test extra
    as_tests = [[w.replace('.[all]', '.[all,test]') for w in s] for s in main_job[:-1]]
    assert as_tests == tests[:-1], "README command 1 installs differ from command 2's"
