"""The spool is safe to share: ownership by a lock held by a live process (not by PID), file
names unique across processes, hosts and re-inits, owner-only files, no credential on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tracer
from tests._servers import closed_port_url
from tracer.config import TraceConfig
from tracer.spool import BackendSpool

_WRITER = """
import sys, time
from tracer.config import TraceConfig
from tracer.spool import BackendSpool
spool = BackendSpool(sys.argv[1], "jsonl", "dest", TraceConfig(backend=None), 1 << 20)
for i in range(3):
    spool.write([b'{"batch": %d}' % i])
print("ready", flush=True)
time.sleep(300)
"""


def _writer(root: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], stdout=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_live_owner_keeps_its_batches_dead_owner_is_replayed_even_with_our_pid(tmp_path: Path):
    root = tmp_path / "spool"
    writer = _writer(root)
    try:
        mine = BackendSpool(str(root), "jsonl", "dest", TraceConfig(backend=None), 1 << 20)
        assert mine.orphans() == []  # another process holds them: hands off while it lives
        own = mine.write([b'{"mine": 1}'])
        assert own is not None and own not in mine.orphans()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    # The writer died. Make its files look like PID reuse: the same host and *our* PID (a
    # restarted container often gets the PID of the one that died). A PID check would call
    # them alive forever; the lock says they are not.
    for p in mine.dir.glob("*.jsonl"):
        if p != own:
            stamp, host, pid, token, counter, tail = p.name.split("_")
            p.rename(p.with_name("_".join([stamp, host, str(os.getpid()), token, counter, tail])))
    for lock in mine.dir.glob("*.owner"):
        host, pid, token = lock.stem.split("_")
        if pid != str(os.getpid()):
            lock.rename(lock.with_name(f"{host}_{os.getpid()}_{token}.owner"))
    orphans = mine.orphans()
    assert len(orphans) == 3 and own not in orphans
    assert [mine.claim(p) is not None for p in orphans] == [True] * 3
    assert [mine.claim(p) for p in orphans] == [None] * 3  # one winner per file


def test_names_are_unique_per_init_and_files_are_owner_only(tmp_path: Path):
    a = BackendSpool(str(tmp_path), "jsonl", "dest", TraceConfig(backend=None), 1 << 20)
    b = BackendSpool(str(tmp_path), "jsonl", "dest", TraceConfig(backend=None), 1 << 20)
    paths = [a.write([b"{}"]), b.write([b"{}"]), a.write([b"{}"]), b.write([b"{}"])]
    assert len({p for p in paths if p is not None}) == 4
    for p in paths:
        assert p is not None and (p.stat().st_mode & 0o077) == 0
    assert (a.dir.stat().st_mode & 0o077) == 0
    assert a.orphans() == [] and b.orphans() == []  # both alive in this process
    b.release()
    assert len(a.orphans()) == 2  # released: b's batches are up for replay


def test_no_credential_reaches_the_spool(tmp_path: Path):
    url = closed_port_url().replace("http://", "http://alice:hunter2-password@")
    tracer.init(
        backend="otlp",
        otlp_endpoint=url + "?token=tok-123456",
        otlp_headers={"Authorization": "Bearer sk-live-abcdefghijklmnop"},
        spool_dir=str(tmp_path / "spool"),
        export_max_retries=0,
        export_timeout_s=1,
        flush_interval_s=0.05,
        shutdown_timeout_s=1,  # nothing listens: the teardown's shutdown stops probing after 1 s
    )

    @tracer.trace_op(kind="tool")
    def tool(x: int) -> int:
        return x

    with tracer.trace_attr(step=0, sample_index=0):
        tool(1)
    assert tracer.flush(1) is False  # nothing listens: the batch waits in the spool
    files = [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in files)
    assert any(p.name == "destination.json" for p in files)
    for p in files:
        text = p.read_bytes().decode(errors="replace")
        for secret in ("hunter2", "alice:", "sk-live-abcdefghijklmnop", "tok-123456"):
            assert secret not in text, f"{secret} written to {p}"
