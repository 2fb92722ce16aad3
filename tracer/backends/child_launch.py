"""How the export child is started (``tracer.backends.subprocess_proxy``), so that nobody
notices it:

- **Isolated imports.** ``python -m`` and ``-c`` put the working directory first on
  ``sys.path``: a user's ``orjson.py``, ``mlflow.py`` or ``tracer/`` there would be imported by
  the child. It starts with ``-I`` (no working directory, no ``PYTHONPATH``, no user site) and
  sets the parent's ``sys.path`` explicitly (so editable installs and ``PYTHONPATH`` users still
  work), without that implicit working-directory entry and with the folder of this very
  ``tracer`` package ahead of any other folder that holds a ``tracer``. The folder of a script
  run as ``python train.py`` stays, even when it is the working directory: Python put it there
  for the script's own imports (a backend in ``my_backend.py`` beside it), so the child can
  import what the parent could.
- **Tied to the process, not a thread.** Linux's parent-death signal fires when the *thread*
  that forked the child ends. Every child is forked by one long-lived daemon thread of ours,
  so ``tracer.init()`` from a short-lived thread does not kill it.
- **Its whole group dies on a failed start.** The child leads a session of its own; a start
  that fails (a ``sys.executable`` that is a wrapper script without ``exec``) kills the group.
- **No raw pipe descriptor crosses a fork.** Pipes are made (close-on-exec) and registered
  under one lock that a fork takes too; a forked process closes whatever is registered.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

MODULE = "tracer.backends.export_process"
# run by ``python -I -c``: stdlib only until sys.path is the parent's
BOOT = (
    "import sys, json; path = json.loads(sys.argv[1]); "
    "sys.path[:] = path + [p for p in sys.path if p not in path]; sys.argv[1:2] = []; "
    f"import runpy; runpy.run_module({MODULE!r}, run_name='__main__', alter_sys=True)"
)


def tracer_root() -> str:
    """The folder that holds this ``tracer`` package."""
    here = os.path.abspath(__file__)  # <root>/tracer/backends/child_launch.py
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


def script_folder() -> str | None:
    """The folder of the script this process runs (``python train.py``), which Python put first
    on ``sys.path``; None under ``python -m`` (``__main__`` has a spec), ``-c`` or a REPL (no
    file), where the first entry is the working directory's implicit one."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        return None
    file = getattr(main, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) if isinstance(file, str) and file else None


def child_path(path: list[str] | None = None, cwd: str | None = None,
               script: str | None = None) -> list[str]:  # fmt: skip
    """The child's ``sys.path``: the parent's, absolute, without the working directory (``''``
    or the folder itself: the user's, whatever it holds) unless it is the folder of the script
    being run (``script``, default :func:`script_folder`), and with this ``tracer``'s folder
    before any other folder that has a ``tracer`` module or package."""
    cwd = os.getcwd() if cwd is None else cwd
    script = script_folder() if script is None and path is None else script
    root = tracer_root()
    out: list[str] = []
    for entry in sys.path if path is None else path:
        if not entry or not isinstance(entry, str):
            continue
        full = os.path.abspath(entry)
        if (full == cwd and full not in (root, script)) or full in out:
            continue
        out.append(full)
    for i, entry in enumerate(out):
        if entry == root:
            break
        if os.path.isdir(os.path.join(entry, "tracer")) or os.path.isfile(
            os.path.join(entry, "tracer.py")
        ):
            if root in out:
                out.remove(root)
            out.insert(i, root)
            break
    else:
        out.insert(0, root)
    return out


def command(exe: str, parent_pid: int) -> list[str]:
    return [exe, "-I", "-c", BOOT, json.dumps(child_path()), str(parent_pid)]


# pipes --------------------------------------------------------------------------------------
_fds_lock = threading.Lock()
_open_fds: set[int] = set()  # pipe ends made here and not yet owned by a Channel or closed


def pipes() -> tuple[int, int, int, int]:
    """(from_child, to_parent, from_parent, to_child), registered until :func:`release`."""
    with _fds_lock:
        from_child, to_parent = os.pipe()
        from_parent, to_child = os.pipe()
        _open_fds.update((from_child, to_parent, from_parent, to_child))
    return from_child, to_parent, from_parent, to_child


def release(*fds: int, close: bool) -> None:
    """The fds have an owner now (a Channel, whose fork handler closes them) or are closed."""
    with _fds_lock:
        for fd in fds:
            if fd in _open_fds:
                _open_fds.discard(fd)
                if close:
                    with contextlib.suppress(OSError):
                        os.close(fd)


# the launcher thread ------------------------------------------------------------------------
class _Launcher:
    """One daemon thread that runs every ``Popen`` of an export child. It lives as long as the
    process, so the child's parent-death signal fires when the process ends, not a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, args: list[str], timeout_s: float, **kwargs: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rollout-tracer-export-launcher")  # fmt: skip
                self._thread.start()
        box: dict[str, Any] = {"lock": threading.Lock()}
        done = threading.Event()
        self._requests.put((args, kwargs, box, done))
        if not done.wait(timeout_s):
            with box["lock"]:
                if not done.is_set():
                    box["abandoned"] = True  # the launcher kills what it starts after this
                    raise TimeoutError(
                        f"the export process was not started within {timeout_s:.0f} s"
                    )
        if "error" in box:
            raise box["error"]
        return box["proc"]  # type: ignore[no-any-return]

    def _run(self) -> None:
        while True:
            args, kwargs, box, done = self._requests.get()
            try:
                proc: subprocess.Popen[bytes] | None = subprocess.Popen(args, **kwargs)
            except BaseException as exc:  # handed to the caller
                proc, box["error"] = None, exc
            with box["lock"]:
                box["proc"] = proc
                done.set()
                abandoned = box.get("abandoned", False)
            if abandoned and proc is not None:
                kill_group(proc)
                proc.wait()


_launcher = _Launcher()


def popen(args: list[str], timeout_s: float, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **kwargs)``, run on the launcher thread."""
    return _launcher.popen(args, timeout_s, **kwargs)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the child's whole process group (it leads its own session), while the child
    is not yet reaped (so the group id is still its own), else to the child alone (a no-op)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()


def _before_fork() -> None:
    _fds_lock.acquire()


def _after_fork_in_parent() -> None:
    _fds_lock.release()


def _after_fork_in_child() -> None:
    global _fds_lock, _launcher
    for fd in _open_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_fds.clear()
    _fds_lock = threading.Lock()
    _launcher = _Launcher()  # the thread did not come along: the next start makes its own


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
