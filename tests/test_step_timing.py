"""``rollout-tracer run`` logs where each step's time went (``timing/*``: the tracer's live
analysis, tracer/live/) to its trackers, and the numbers are those the export's ``steps`` table
finds afterwards in the stored spans (the same reader, tracer/readers/timing/breakdown.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pq = pytest.importorskip("pyarrow.parquet")


@pytest.mark.slow(seconds=12)
def test_the_driver_logs_what_the_export_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout.cli import main
    from rollout.trackers import Tracking
    from tracer.readers import export

    logged: dict[int, dict[str, float]] = {}
    real_log = Tracking.log

    def spy_log(self: Tracking, metrics: Any, step: int) -> dict[str, float]:
        clean = real_log(self, metrics, step)
        if "timing/tail_ratio" in clean:
            logged[step] = clean
        return clean

    monkeypatch.setattr(Tracking, "log", spy_log)
    import rollout.engines as engines

    real_make = engines.make_engine
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'

    def scripted(prompt: str, index: int) -> str:  # a calculator call, then the answer
        return call if prompt.count("<tool_response>") == 0 else "It is 42. #### 42"

    monkeypatch.setattr(
        engines, "make_engine", lambda config, **kw: real_make(config, script=scripted, **kw)
    )
    jsonl = tmp_path / "t.jsonl"
    code = main(["run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
                 "trainer.total_steps=2", "data.train_batch_size=2",
                 "actor_rollout_ref.rollout.n=4", "trainer.logger=[console]",
                 "trainer.val_before_train=false", "trainer.test_freq=0",
                 "actor_rollout_ref.rollout.trace.backend=jsonl",
                 f"+actor_rollout_ref.rollout.trace.jsonl_path={jsonl}"])  # fmt: skip
    assert code == 0 and sorted(logged) == [1, 2]
    export("jsonl", str(tmp_path / "out"), path=str(jsonl))
    steps = {r["step"]: r for r in pq.read_table(tmp_path / "out" / "steps.parquet").to_pylist()
             if not r["validate"]}  # fmt: skip
    for step, m in logged.items():
        want = steps[step]
        assert m["timing/wall_p50_s"] == pytest.approx(want["wall_p50_ms"] / 1e3, rel=1e-6)
        assert m["timing/wall_max_s"] == pytest.approx(want["wall_max_ms"] / 1e3, rel=1e-6)
        assert m["timing/tail_ratio"] == pytest.approx(want["tail_ratio"], rel=1e-6)
        assert m["timing/tail_wait_s"] == pytest.approx(want["tail_wait_ms"] / 1e3, abs=1e-5)
        assert m["timing/stragglers"] == want["stragglers"]
        for part in ("generate", "tool", "reward", "gap"):
            assert m[f"timing/{part}_share"] == pytest.approx(want[f"{part}_share"], abs=1e-9)
        shares = json.loads(want["tool_shares"])
        assert shares and all(m[f"timing/tool_share/{k}"] == pytest.approx(v, abs=1e-9)
                              for k, v in shares.items())  # fmt: skip
        assert m["timing/generate_share"] > 0
