"""``--from verl-dump``: the JSONL files verl's trainer writes to ``trainer.rollout_data_dir``
come back as our tables and report.

``tests/data/verl_dump/{1,2}.jsonl`` were written by verl 0.9.1's own
``RayPPOTrainer._log_rollout_data`` -> ``_dump_generations`` (tests/verl_cpu.py:
write_verl_dump, in the verl venv); tests/test_verl_installed.py writes them again there and
checks they still equal these files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout.cli import main
from tracer.readers import Selection, iter_records

pq = pytest.importorskip("pyarrow.parquet")

DUMP = Path(__file__).parent / "data" / "verl_dump"


def _records(path: Path, **kwargs: object) -> list:
    return [r for page in iter_records("verl-dump", path=str(path), **kwargs) for r in page]


def test_export_of_a_verl_dump_has_its_samples(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["export", "--from", "verl-dump", "--path", str(DUMP), "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    rows = pq.read_table(out / "trajectories.parquet").to_pylist()
    lines = [json.loads(line) for f in ("1.jsonl", "2.jsonl")
             for line in (DUMP / f).read_text().splitlines()]  # fmt: skip
    assert len(rows) == len(lines) == 4
    rows.sort(key=lambda r: (r["step"], r["sample_index"]))
    for row, line in zip(rows, lines, strict=True):
        assert row["step"] == line["step"]
        assert row["prompt_text"] == line["input"]
        assert row["response_text"] == line["output"]
        assert row["reward"] == line["score"]
        assert row["accuracy"] == line["acc"]  # a reward extra info verl dumped
        assert row["experiment"] == "verl_dump"  # the folder's name without --experiment
        assert row["num_turns"] == 1 and row["validate"] is False
    turns = pq.read_table(out / "turns.parquet").to_pylist()
    assert sorted(t["response_text"] for t in turns) == sorted(x["output"] for x in lines)

    # the same dump read twice gives the same trace ids (exports can be merged/deduplicated)
    assert [r.trace_id for r in _records(DUMP)] == [r.trace_id for r in _records(DUMP)]
    assert len({r.trace_id for r in _records(DUMP)}) == 4


def test_report_and_step_selection(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    assert main(["report", "--from", "verl-dump", "--path", str(DUMP), "--out", str(report),
                 "--experiment", "gsm8k-grpo"]) == 0  # fmt: skip
    html = report.read_text()
    assert "What is 12 + 30? Use the calculator." in html and "gsm8k-grpo" in html
    only2 = _records(DUMP, selection=Selection(steps=[2]), experiment="gsm8k-grpo")
    assert [r.step for r in only2] == [2, 2]
    assert {r.project_name for r in only2} == {"gsm8k-grpo"}


def test_a_cut_last_line_is_skipped_and_a_bad_line_is_an_error(tmp_path: Path) -> None:
    dump = tmp_path / "rollout_data"
    shutil.copytree(DUMP, dump)
    with open(dump / "2.jsonl", "a") as f:
        f.write('{"input": "What is 1 + 1?", "out')  # verl stopped mid-write
    assert len(_records(dump)) == 4
    (dump / "1.jsonl").write_text('{"input": "x"}\nnot json\n{"input": "y"}\n')
    with pytest.raises(ValueError, match=r"1\.jsonl:2"):
        _records(dump)
    assert main(["export", "--from", "verl-dump", "--path", str(tmp_path / "nope"),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2  # fmt: skip
