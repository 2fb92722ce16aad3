"""The compacted copy within its memory cap on realistic text: DuckDB's memory_limit is 1 GB for
a million trajectories; here 16 MB for 6,000 (every turn 60-100 words, tool results 20-50), on
which the copy that sorted each table whole failed with DuckDB's "Out of Memory Error" at 16 and
24 MB. Sorted a slice at a time, it fits, and answers what the export's own files answer. When
it fails all the same, the status says so and the lists read the export."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tests._explore import make_export  # noqa: E402
from tests.test_explore_store import _same  # noqa: E402
from tracer.readers.explore import compact  # noqa: E402
from tracer.readers.explore.server import Explorer  # noqa: E402
from tracer.readers.explore.store import Run, Store  # noqa: E402

N = 6000


def test_compaction_fits_a_small_memory_limit(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "run", N, seed=1, short_text=False)
    turns = pq.read_table(folder / "turns.parquet", columns=["response_text"])
    words = [len(t.split()) for t in turns.column(0).to_pylist()[:500]]
    assert 60 <= sum(words) / len(words) <= 100  # realistic text, as benchmarks make it
    plain = Store([Run("run", str(folder), set())], memory_limit="16MB")
    fast = Store([Run("run", str(folder), set())], memory_limit="16MB")
    out = fast.compact("run", str(tmp_path / "cache"))
    for table, key in (("turns", "turn_index"), ("tool_calls", "call_index"), ("tokens",
                                                                            "position")):
        got = pq.read_table(os.path.join(out, f"{table}.parquet"),
                            columns=["step", "trace_id", key]).to_pylist()  # fmt: skip
        want = pq.read_table(folder / f"{table}.parquet", columns=["step", "trace_id", key])
        assert len(got) == want.num_rows
        assert [(r["step"], r["trace_id"]) for r in got] == sorted(
            (r["step"], r["trace_id"]) for r in want.to_pylist())  # fmt: skip
    a = plain.list_page({"step": ["2:4"]}, None, 3, 25, "-latency_ms", None)
    b = fast.list_page({"step": ["2:4"]}, None, 3, 25, "-latency_ms", None)
    _same(a, b)
    row = a["rows"][0]
    _same(plain.trajectory(None, row["trace_id"], row["step"]), fast.trajectory(None,
                                                                                row["trace_id"]))


def test_sorted_copy_a_slice_at_a_time(tmp_path: Path) -> None:
    """Slices of consecutive steps, a step larger than a slice cut at trace id quantiles, rows
    without a step last: appended, they are the whole table sorted."""
    import duckdb

    steps = [1] * 300 + [2] * 40 + [3] * 40 + [None] * 250 + [4] * 10
    ids = [f"{(i * 7919) % 1000:03x}" for i in range(len(steps))]
    src = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"step": pa.array(steps, pa.int64()), "trace_id": ids,
                             "i": list(range(len(steps)))}), src, row_group_size=50)  # fmt: skip
    cur = duckdb.connect()
    slices = compact._slices(cur, f"read_parquet({compact.quote(src)})", 100)
    assert len(slices) == 3 + 1 + 3  # step 1 in 3, steps 2-4 together, the nulls in 3
    dest = str(tmp_path / "sorted.parquet")
    compact._sorted_copy(cur, src, dest, rows=16, budget=100 * 40, check=lambda: None)
    got = pq.read_table(dest).to_pylist()
    rows = pq.read_table(src).to_pylist()
    key = lambda r: (r["step"] is None, r["step"] or 0, r["trace_id"])  # noqa: E731
    assert [key(r) for r in got] == sorted(key(r) for r in rows)
    assert sorted(r["i"] for r in got) == list(range(len(steps)))  # each row once
    assert compact.parse_bytes("1GB") == 10**9 and compact.parse_bytes("64 MiB") == 64 * 2**20


def test_a_failed_compaction_is_said_and_lists_stay_correct(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "run", 300, seed=2)
    explorer = Explorer(Store([Run("run", str(folder), set())]))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "compact").write_text("a file where the copies' folder goes")
    explorer.build_indexes(cache_dir=str(cache))
    status = explorer.handle("/api/status", {})["runs"][0]["compaction"]
    assert status["state"] == "failed" and "compact" in status["error"], status
    page = explorer.handle("/api/list", {"step": ["2:3"], "size": ["5"]})
    rows = pq.read_table(folder / "trajectories.parquet").to_pylist()
    assert page["total"] == sum(1 for r in rows if 2 <= r["step"] <= 3)
    assert explorer.store.runs["run"].data is None  # the export's own files
