"""The README's snippets are tests: every Python block runs as written and traces what the text
says it traces; the configuration table documents exactly TraceConfig's fields."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tracer.config import TraceConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[tuple[str, str]]:
    """(the heading above it, the code) for each ```python block."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        blocks.append((headings[-1] if headings else "", match.group(1)))
    return blocks


def check_own_rollout(tmp: Path, printed: str) -> None:
    from tracer.record import read_jsonl

    records = list(read_jsonl(str(tmp / "traces" / "my-run.jsonl")))
    assert len(records) == 4  # 1 sample x n=4
    assert sorted(r.rollout_n for r in records) == [0, 1, 2, 3]
    for r in records:
        assert (r.project_name, r.experiment_name, r.step) == ("gsm8k-grpo", "run-7", 1)
        kinds = [s.kind for s in r.spans]
        assert kinds.count("trajectory") == 1, kinds  # only the root: no nested trajectory
        assert sorted(kinds) == ["generate", "reward", "tool", "trajectory"], kinds
        assert r.reward == 1.0
    assert printed.startswith("[1.0, 1.0, 1.0, 1.0]")


# heading of the block -> what it must have done (a new block needs its own check here)
CHECKS: dict[str, Callable[[Path, str], None]] = {
    "Use it in your own rollout": check_own_rollout,
}


@pytest.mark.parametrize(("heading", "code"), python_blocks(), ids=lambda v: str(v)[:30])
def test_readme_python_block_runs_as_written(
    heading: str, code: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert heading in CHECKS, f"README block under {heading!r} has no check in this test"
    exec(compile(code, f"README.md ({heading})", "exec"), {"__name__": "__main__"})
    CHECKS[heading](tmp_path, capsys.readouterr().out)


def test_the_config_table_documents_every_field() -> None:
    text = README.read_text()
    section = text[text.index("### Configuration (`tracer.TraceConfig`)"):]
    section = section[: section.index("\n\n", section.index("| field |"))]
    documented: set[str] = set()
    for row in section.splitlines()[2:]:
        first_cell = row.split("|")[1]
        documented.update(re.findall(r"`([a-z_0-9]+)`", first_cell))
    fields = {f.name for f in dataclasses.fields(TraceConfig)}
    assert fields - documented == set(), "fields missing from README's table"
    assert documented - fields == set(), "README's table names fields TraceConfig lacks"
