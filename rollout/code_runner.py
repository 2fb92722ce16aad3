"""Runs model-written Python in a child process: limits, no survivors, and, where bubblewrap
works, no view of the host's files or network. Linux only.

Always:
- a fresh interpreter in isolated mode (``-I -S``: no site-packages, no ``PYTHON*`` variables,
  no user site), an environment of ``PATH`` and ``PYTHONIOENCODING`` only, stdin ``/dev/null``;
- resource limits on it and on everything it starts: address space, CPU seconds, 1 MiB per
  written file, no core dumps;
- no survivors: a small supervisor process is the code's parent and a child subreaper
  (``prctl(PR_SET_CHILD_SUBREAPER)``), so processes the code starts, even those that fork twice
  or call ``setsid()``, stay its descendants; when the code ends, times out, or the caller goes
  away (the supervisor's control pipe closes), it kills every descendant and reaps them.

With bubblewrap (``bwrap``; Debian and Ubuntu package ``bubblewrap``) where it can create
namespaces (``isolation="auto"`` uses it then, ``"bwrap"`` requires it):
- files: the code sees ``/usr`` and the interpreter's own prefix read-only, a private ``/proc``,
  a minimal ``/dev``, an empty in-memory ``/tmp`` (64 MiB), and ``writable_dir`` if given; not
  the home folder, the working directory, nor any other host path;
- network: none (a network namespace with no interface up);
- processes: its own PID, IPC and UTS namespaces, all capabilities dropped; it cannot see or
  signal host processes, and when the supervisor ends the kernel kills whatever is left.

Without it (``isolation="none"``, or ``"auto"`` where ``bwrap`` is missing or cannot create
namespaces, as in some containers; one log line says so) the code runs as the rollout's user,
in ``writable_dir`` (else a fresh temporary folder), with the same file system and network: it
can read what that user can read (``~/.bashrc``, credential files), write where that user can
write (1 MiB per file), and connect anywhere. Code that kills its own supervisor first can
leave processes behind in that mode; the supervisor's process group is killed as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger("rollout")

ISOLATION_MODES = ("auto", "bwrap", "none")
TMPFS_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 5.0  # for the supervisor to kill and reap everything after its pipe closes

# The supervisor: a single-threaded interpreter of its own, so fork and exec here are safe
# (in the rollout's process, with its threads, Python between fork and exec could deadlock).
# It sets the limits (inherited across exec), becomes a child subreaper, spawns the code, and
# waits for the code to end or its stdin (the caller's control pipe) to close.
_SUPERVISOR = r"""
import ctypes, os, resource, select, signal, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("python tool: cannot become a child subreaper (prctl: errno %d)" % ctypes.get_errno())
for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"), sys.argv[1:5]):
    limit = getattr(resource, name)
    value, hard = int(value), resource.getrlimit(limit)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))
me = os.getpid()

def descendants():
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry, "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [me]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found

def kill_all():
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = descendants()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not pids:
            return
        time.sleep(0.002)

code = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", sys.argv[5]],
                      dict(os.environ),
                      file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)])
try:
    watch = [0, os.pidfd_open(code)]
except (AttributeError, OSError):
    watch = [0]
status = None
while status is None:
    ready = select.select(watch, [], [], None if len(watch) > 1 else 0.05)[0]
    if 0 in ready and not os.read(0, 4096):
        kill_all()
        os._exit(128 + signal.SIGKILL)
    pid, raw = os.waitpid(code, os.WNOHANG)
    if pid:
        status = raw
kill_all()
if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
"""


@dataclass
class Completed:
    """How the code ended: ``returncode`` (128 + N: killed by signal N), and its output."""

    returncode: int
    stdout: bytes
    stderr: bytes


class RunTimeout(Exception):
    """The code ran past its time; every process it started has been killed."""


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def bwrap_works(path: str) -> str:
    """'' when ``path`` can create the namespaces this module asks for, else why not."""
    try:
        done = subprocess.run(
            [path, *_bwrap_args(None), "--", _interpreter(), "-I", "-S", "-c", "pass"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return done.stderr.decode("utf-8", "replace").strip()[-300:] or f"exit {done.returncode}"
    return ""


def resolve_isolation(isolation: str) -> str | None:
    """The ``bwrap`` path to use, or None (limits and process cleanup only); raises ValueError
    for an unknown mode, or for ``"bwrap"`` where it cannot run."""
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, got "
                         f"{isolation!r}")  # fmt: skip
    if isolation == "none":
        return None
    path = find_bwrap()
    why = "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    if path is not None:
        why = bwrap_works(path)
        if not why:
            return path
        why = f"bwrap cannot create its namespaces here: {why}"
    if isolation == "bwrap":
        raise ValueError(f"python tool: isolation='bwrap' but {why}")
    _warn_once(why)
    return None


@functools.cache
def _warn_once(why: str) -> None:
    log.warning(
        "python tool: %s; model code runs WITHOUT file-system or network isolation "
        "(resource limits and killing every process it starts still apply).",
        why,
    )


def _interpreter() -> str:
    return os.path.realpath(sys.executable)


def _bwrap_args(writable_dir: str | None) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr"]  # fmt: skip
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: the link, not a bind
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    exe = _interpreter()
    for prefix in {sys.base_prefix, os.path.dirname(os.path.dirname(exe))}:
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp"]
    if writable_dir is not None:
        args += ["--bind", writable_dir, writable_dir, "--chdir", writable_dir]
    else:
        args += ["--chdir", "/tmp"]
    return args


async def run_python(
    code: str,
    *,
    limits: tuple[int, int, int, int],
    timeout_s: float,
    bwrap: str | None,
    writable_dir: str | None = None,
    max_output_bytes: int = 1 << 20,
) -> Completed:
    """Run ``code`` under the supervisor (inside bubblewrap when ``bwrap`` is a path).
    ``limits``: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_CORE. Raises RunTimeout after
    ``timeout_s``, once every process of the code is gone."""
    if writable_dir is not None:
        writable_dir = os.path.realpath(writable_dir)
    with contextlib.ExitStack() as stack:
        cwd = writable_dir
        if cwd is None and bwrap is None:
            cwd = stack.enter_context(tempfile.TemporaryDirectory(prefix="python-tool-"))
        argv = [_interpreter(), "-I", "-S", "-c", _SUPERVISOR, *map(str, limits), code]
        if bwrap is not None:
            argv = [bwrap, *_bwrap_args(writable_dir), "--", *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8"},
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        reads = asyncio.gather(_read(proc.stdout, max_output_bytes),
                               _read(proc.stderr, max_output_bytes), proc.wait())  # fmt: skip
        try:
            out, err, rc = await asyncio.wait_for(reads, timeout_s)
        except asyncio.TimeoutError:
            await _stop(proc)
            raise RunTimeout(f"timed out after {timeout_s:g} s") from None
        except asyncio.CancelledError:
            await _stop(proc)
            raise
        return Completed(rc, out, err)


async def _read(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Up to ``limit`` bytes; the rest is read and dropped (a writer never blocks on us)."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, limit - len(kept))]
    return bytes(kept)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Close the control pipe: the supervisor kills and reaps every descendant, then exits.
    Its process group is killed too, and after STOP_GRACE_S the supervisor itself."""
    if proc.stdin is not None:
        proc.stdin.close()
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_GRACE_S)


def signal_of(returncode: int) -> int | None:
    """The signal that ended the code, from the supervisor's exit code (128 + N)."""
    if returncode < 0:
        return -returncode
    return returncode - 128 if 128 < returncode < 128 + 65 else None
