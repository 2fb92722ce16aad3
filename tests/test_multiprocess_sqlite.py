"""Several processes tracing into one sqlite store at once (verl's docs warn about it): the
first open is serialized (MLflow migrates the schema then), writes are retried and spooled, and
every trajectory lands exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import search_traces

pytest.importorskip("mlflow")
ROOT = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import sys, time, tracer
    uri, wid = sys.argv[1], sys.argv[2]
    tracer.init(backend="mlflow", tracking_uri=uri, project_name="multi", worker_id=wid,
                spool_dir="spool-" + wid, raise_internal_errors=True)

    @tracer.trace_op(kind="generate")
    def generate(prompt):
        return prompt[::-1]

    for i in range(100):
        with tracer.trace_attr(step=i // 50, sample_index="%s-%d" % (wid, i)):
            generate("question %d" % i)
        time.sleep(0.002)
    sys.exit(0 if tracer.flush(240) else 3)
""")


@pytest.mark.slow(seconds=9)
def test_three_processes_share_one_new_sqlite_store(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'shared.db'}"  # a new file: all three race to create it
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), uri, w], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in ("w0", "w1", "w2")]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    traces = search_traces(uri, "multi")
    keys = [t.info.tags["sample_index"] for t in traces]
    assert len(keys) == 300 and len(set(keys)) == 300
    assert {t.info.tags["worker_id"] for t in traces} == {"w0", "w1", "w2"}
