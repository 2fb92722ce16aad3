"""The export child's garbage collector: the child is the tracer's own process, so its
long-lived objects are frozen and it makes no automatic passes while a call runs; one pass after
each call collects the cycles the call left (``freeze_long_lived`` in
tracer/backends/export_process.py). The user's process keeps its collector as it was.

A real job process whose backend (a JSONL exporter beside the script, run in the export child)
notes, in each call, whether automatic collection is on, and leaves a cycle behind it: the next
call sees whether that cycle was collected in between."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux export child"),
    pytest.mark.export_child,
]

ROOT = Path(__file__).resolve().parents[1]

NOTING_BACKEND = textwrap.dedent("""
    import gc, json, os, weakref
    from tracer.backends.jsonl_backend import JsonlExporter

    class Cycle:
        pass

    _last = None  # a weak reference to the cycle the previous call left

    class NotingExporter(JsonlExporter):
        name = "noting"

        def export_encoded(self, batch, lines, *, replay=False):
            global _last
            note = {"pid": os.getpid(), "enabled": gc.isenabled(),
                    "previous_cycle_alive": None if _last is None else _last() is not None}
            with open(os.path.join(os.path.dirname(__file__), "notes"), "a") as f:
                f.write(json.dumps(note) + "\\n")
            a, b = Cycle(), Cycle()
            a.other, b.other = b, a
            _last = weakref.ref(a)
            return super().export_encoded(batch, lines, replay=replay)
""")

JOB = textwrap.dedent("""
    import gc, json, os
    import tracer
    from tracer.backends import register_backend

    register_backend("noting", "noting_backend:NotingExporter")
    tracer.init(backend="noting", jsonl_path="traces.jsonl", project_name="p",
                spool_dir="spool", export_in_subprocess=True, export_interval_s=0)

    @tracer.trace_op(kind="generate")
    def generate(prompt):
        return prompt.upper()

    for i in range(4):
        with tracer.trace_attr(step=0, sample_index=i):
            generate("question %d" % i)
        assert tracer.flush(60)  # one call each
    print(json.dumps({"me": os.getpid(), "enabled": gc.isenabled(),
                      "frozen": gc.get_freeze_count()}))
    tracer.shutdown()
""")


def test_the_child_collects_between_calls_and_the_users_process_is_untouched(
    tmp_path: Path,
) -> None:
    (tmp_path / "noting_backend.py").write_text(NOTING_BACKEND)
    (tmp_path / "job.py").write_text(JOB)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout.strip().splitlines()[-1])
    assert job == {"me": job["me"], "enabled": True, "frozen": 0}  # the user's, as it was
    notes = [json.loads(line) for line in (tmp_path / "notes").read_text().splitlines()]
    assert len(notes) == 4
    assert {n["pid"] for n in notes} != {job["me"]} and len({n["pid"] for n in notes}) == 1
    assert not any(n["enabled"] for n in notes)  # no automatic passes in a call
    # each call's cycle was gone by the next call: the pass after each call collected it
    assert [n["previous_cycle_alive"] for n in notes] == [None, False, False, False]
    assert len((tmp_path / "traces.jsonl").read_text().splitlines()) == 4
