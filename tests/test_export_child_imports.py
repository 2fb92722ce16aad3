"""The export child imports what the parent could (issue 56): ``cd proj && python train.py``, where
train.py registers a backend from ``my_backend.py`` beside it, exports from the child with
``export_in_subprocess=True`` (the script's folder is not the implicit working-directory entry
of ``python -m``/``-c``, which the child still leaves out); a backend registered as a callable
works in the child when it can be imported, and is refused at ``init`` with one line when it
cannot; a ``sys.executable`` that is a wrapper script without ``exec`` is named in the error.

Each case is a real job process; the backend is the real MLflow exporter (a subclass that notes
the pid of the process that exported), read back with MLflow's client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.test_export_child import keys, stored
from tracer.backends.child_launch import child_path, tracer_root

pytest.importorskip("mlflow")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux export child"),
    pytest.mark.export_child,
]

ROOT = Path(__file__).resolve().parents[1]

MY_BACKEND = textwrap.dedent("""
    import os
    from tracer.backends.mlflow_backend import MlflowExporter

    class MyExporter(MlflowExporter):
        name = "mine"

        def export(self, batch, *, replay=False):
            with open(os.path.join(os.path.dirname(__file__), "exported_by"), "a") as f:
                f.write(f"{os.getpid()}\\n")
            return super().export(batch, replay=replay)
""")

TRAIN = textwrap.dedent("""
    import json, os, sys
    import tracer
    from tracer.backends import register_backend
    import my_backend

    how, uri, *exe = sys.argv[1:]
    if exe:  # the Python that starts the export child (an embedding host may name another)
        sys.executable = exe[0]
    if how == "path":
        register_backend("mine", "my_backend:MyExporter")
    elif how == "callable":
        register_backend("mine", my_backend.MyExporter)
    else:
        class Local(my_backend.MyExporter):
            pass
        register_backend("mine", Local)
    try:
        tracer.init(backend="mine", tracking_uri=uri, project_name="p", spool_dir="spool",
                    export_in_subprocess=True, flush_interval_s=0.05)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(0)
    exporter = tracer.get_tracer().pipeline.workers[0].exporter

    @tracer.trace_op(kind="generate")
    def generate(prompt):
        return prompt.upper()

    for i in range(5):
        with tracer.trace_attr(step=0, sample_index=i):
            generate("question %d" % i)
    print(json.dumps({"ok": tracer.flush(60), "kind": type(exporter).__name__,
                      "child": exporter.pid, "me": os.getpid()}))
    tracer.shutdown()
""")


def run_train(tmp_path: Path, uri: str, how: str, *exe: str) -> dict[str, Any]:
    """``cd proj && python train.py HOW URI [EXE]``; its JSON line."""
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "my_backend.py").write_text(MY_BACKEND)
    (proj / "train.py").write_text(TRAIN)
    done = subprocess.run([sys.executable, "train.py", how, uri, *exe], cwd=proj,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_scripts_folder_stays_on_the_childs_path_the_implicit_cwd_does_not(
    tmp_path: Path,
) -> None:
    """A script's folder is kept even when it is the working directory; '' (``-c``) and the
    working directory of ``python -m`` (no script) are left out."""
    root = tracer_root()
    proj = str(tmp_path / "proj")
    assert child_path([proj, "/usr/lib"], proj, script=proj) == [root, proj, "/usr/lib"]
    assert child_path([proj, "/usr/lib"], proj, script=None) == [root, "/usr/lib"]
    assert child_path(["", "/usr/lib"], proj, script=proj) == [root, "/usr/lib"]


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("how", ["path", "callable"])
def test_a_backend_beside_the_script_exports_from_the_child(
    tmp_path: Path, mlflow_uri: str, how: str
) -> None:
    """``register_backend("mine", "my_backend:MyExporter")`` and the same class registered as a
    callable: the child imports it from the script's folder (it was dropped as the cwd:
    ModuleNotFoundError; the callable was never sent at all) and exports every trajectory."""
    said = run_train(tmp_path, mlflow_uri, how)
    assert "error" not in said, said["error"]
    assert said["ok"] and said["kind"] == "SubprocessExporter", said
    exporters = {int(p) for p in (tmp_path / "proj" / "exported_by").read_text().split()}
    assert exporters == {said["child"]} and said["child"] != said["me"]
    assert stored(mlflow_uri) == keys(0, 5)


@pytest.mark.slow(seconds=10)
def test_a_callable_the_child_cannot_import_is_refused_at_init_in_one_line(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """A class defined in the script itself (``__main__``): the child never runs the user's
    script, so init says so and how to fix it, instead of a start error about an unknown
    backend."""
    said = run_train(tmp_path, mlflow_uri, "main")
    error = said.get("error", "")
    assert error.startswith("ConfigError: backend 'mine' is registered as"), said
    assert "cannot import (defined in __main__" in error and "\n" not in error, error
    assert "export_in_subprocess=False" in error


@pytest.mark.slow(seconds=10)
def test_a_wrapper_executable_without_exec_is_named_in_the_error(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """``sys.executable`` is a shell script that runs Python without ``exec`` (so the Python is
    the wrapper's child, not ours): the error names it and says why, not a bare EOFError."""
    wrapper = tmp_path / "wrap" / "python3"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n{sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    said = run_train(tmp_path, mlflow_uri, "path", str(wrapper))
    error = said.get("error", "")
    assert f"{wrapper} did not start the export process" in error, said
    assert "without `exec`" in error and "\n" not in error, error
