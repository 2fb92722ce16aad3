"""A newcomer's path: following only the README's first screen (its first 60 lines), a fresh venv
gets to a traced run and a browsable UI.

What is tested where, and why this way. A fresh venv costs ~3 minutes of installs on 2 cores;
the suite cannot afford one per run, and a venv made with `--system-site-packages` would not be
fresh. So the path is checked in two halves that meet:
- the install: the first screen's commands are, step for step, the ones `.ci/run` executes in
  a fresh venv (`.venv-ci`) on every landing (cheap, here);
- the run and the UI: the first screen's run command, exactly as written, in an empty folder,
  in this test's environment (the packages those installs put there), then the UI command it
  names, serving that run's traces (slow: it is the main job).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._markdown import README, ROOT, fenced_blocks

FIRST_SCREEN = 60


def first_screen() -> str:
    return "".join(README.read_text().splitlines(keepends=True)[:FIRST_SCREEN])


def first_screen_commands() -> list[list[list[str]]]:
    """Each command line of the first screen's shell blocks, as its `&&`-separated steps."""
    lines = []
    for lang, _, code in fenced_blocks(first_screen()):
        if lang == "bash":
            for line in code.splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    steps: list[list[str]] = []
                    current: list[str] = []
                    for word in [*words, "&&"]:
                        if word == "&&":
                            steps.append(current)
                            current = []
                        else:
                            current.append(word)
                    lines.append(steps)
    return lines


def ci_steps() -> list[list[str]]:
    """What .ci/run does in its fresh venv, in order: the venv, the installs, the tests."""
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


@pytest.mark.slow
def test_the_first_screen_gets_a_newcomer_to_a_traced_run_and_a_browsable_ui(
    tmp_path: Path,
) -> None:
    """The main job as the first screen writes it (the console script's entry point, from this
    checkout), in an empty folder, then `rollout-tracer ui` on what it wrote."""
    [main_job] = [s for s in first_screen_commands() if s[-1] == ["rollout-tracer", "run"]]
    [[ui]] = [s for s in first_screen_commands() if s[0][:2] == ["rollout-tracer", "ui"]]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_TRACKING", "ROLLOUT_"))}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cli = [sys.executable, "-m", "rollout.cli"]
    # the main job: 78 s on 2 quiet cores, 24 min at a load average of 8: the bound is for a hang
    run = subprocess.run([*cli, *main_job[-1][1:]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^done: 8 training \+ 4 validation trajectories", run.stdout, re.M)
    assert "rollout-tracer ui" in run.stdout  # it says how to browse
    assert (tmp_path / "mlflow.db").exists()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*cli, *ui[1:], "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        url, said = None, []
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # ends when the command exits
            said.append(line)
            if line.startswith("MLflow trace UI: "):
                url = line.split(": ", 1)[1].strip()
                break
            assert time.monotonic() < deadline, "".join(said)
        assert url and url.startswith(f"http://127.0.0.1:{port}/#/experiments/"), "".join(said)
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read(4096).lower()
        exp_id = url.split("/experiments/")[1].split("/")[0]
        body = json.dumps({"locations": [{"type": "MLFLOW_EXPERIMENT",
                                          "mlflow_experiment": {"experiment_id": exp_id}}],
                           "max_results": 50}).encode()  # fmt: skip
        search = urllib.request.Request(
            f"http://127.0.0.1:{port}/ajax-api/3.0/mlflow/traces/search", data=body,
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(search, timeout=60) as resp:
            assert len(json.loads(resp.read())["traces"]) == 12  # 8 training + 4 validation
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the ui stops its server's group on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
