"""The explorer's store without HTTP: the compacted copy answers exactly what the export's own
files answer (list pages, counts, histograms, one trajectory), the lookup by row-group
statistics finds rows that cross row-group edges, and the caches stay within their bounds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("tantivy")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import orjson  # noqa: E402

from tests._explore import make_export  # noqa: E402
from tracer.readers.explore import compact  # noqa: E402
from tracer.readers.explore.cache import LRU, prune_folder  # noqa: E402
from tracer.readers.explore.search import SearchIndex  # noqa: E402
from tracer.readers.explore.server import Explorer  # noqa: E402
from tracer.readers.explore.store import KEEP_COMPACTED, Run, Store  # noqa: E402

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("explore-store")

N = 3000  # 9,000 turns and 36,000 tokens: several row groups of the compacted copy


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, Store, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("store")
    folder = make_export(root / "run", N, seed=3)
    plain = Store([Run("run", str(folder), set())])
    fast = Store([Run("run", str(folder), set())])
    fast.compact("run", str(root / "cache"))
    return plain, fast, pq.read_table(folder / "trajectories.parquet").to_pylist()


def _same(a: Any, b: Any) -> None:
    assert orjson.loads(orjson.dumps(a, default=str)) == orjson.loads(orjson.dumps(b, default=str))


@pytest.mark.parametrize("query, sort", [
    ({}, None), ({}, "-reward"), ({"step": ["2:4"], "validate": ["false"]}, "-latency_ms"),
    ({"reward": ["0.5:"], "tool_errors": ["true"]}, "response_tokens"),
    ({"flag": ["truncated"]}, "-mismatch_kl_mean"), ({"step": ["999"]}, None),
])  # fmt: skip
def test_compacted_list_equals_the_exports(stores: Any, query: dict[str, list[str]],
                                           sort: str | None) -> None:  # fmt: skip
    plain, fast, rows = stores
    assert fast.runs["run"].data and not plain.runs["run"].data
    for page in (0, 3):
        a = plain.list_page(query, None, page, 25, sort, None)
        b = fast.list_page(query, None, page, 25, sort, "trace_id,prompt,reward,flags,step")
        _same(b["rows"], [{k: r[k] for k in b["columns"]} for r in a["rows"]])
        assert a["total"] == b["total"] and a["histogram"] == b["histogram"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"])
    if not query:
        assert a["total"] == N
        assert sum(h["count"] for h in a["histogram"]) == sum(r["reward"] is not None for r in rows)


def test_compacted_trajectory_equals_the_exports(stores: Any) -> None:
    plain, fast, rows = stores
    for row in rows[::97]:
        a = plain.trajectory(None, row["trace_id"], row["step"])
        b = fast.trajectory(None, row["trace_id"])  # by id alone: the ids file
        _same(a, b)
        assert len(b["turns"]) == 3 and sum(len(t) for t in b["tokens"].values()) == 12


def test_sorted_lookup_crosses_row_group_edges(tmp_path: Path) -> None:
    # 3 rows per key, 7 rows per row group: many keys cross an edge; a few null steps last
    keys = sorted((s, f"{t:04x}") for s in range(1, 9) for t in range(0, 60, 7))
    step = [s for s, _ in keys for _ in range(3)] + [None] * 4
    tid = [t for _, t in keys for _ in range(3)] + ["ffff"] * 4
    path = str(tmp_path / "sorted.parquet")
    pq.write_table(pa.table({"step": pa.array(step, pa.int64()), "trace_id": tid,
                             "i": list(range(len(step)))}), path, row_group_size=7)  # fmt: skip
    lookup = compact.Sorted(path, ("step", "trace_id"))
    for s, t in keys:
        found = lookup.find(s, t, columns=["i"]).column("i").to_pylist()
        assert found == [i for i in range(len(step)) if (step[i], tid[i]) == (s, t)]
        # its own row groups (two where it crosses an edge), and those holding two steps
        assert 1 <= len(lookup.groups(s, t)) <= 4
    assert lookup.find(3, "0001", columns=["i"]).num_rows == 0
    assert lookup.find(99, "0000").num_rows == 0


def test_lru_bounds_entries_and_bytes() -> None:
    cache = LRU(max_entries=10, max_bytes=1000)
    for i in range(100):
        assert cache.get(("k", i), lambda i=i: "x" * (i % 150)) == "x" * (i % 150)
        assert len(cache) <= 10 and cache.bytes <= 1000
    assert cache.evicted > 0
    cache.put("big", "y" * 2000)  # larger than the whole budget: not kept
    assert cache.get("big", lambda: "again") == "again" and cache.bytes <= 1000
    cache.get(("k", 99), lambda: "recomputed")  # the most recent entries are kept
    assert cache.get(("k", 99), lambda: "z") == "x" * (99 % 150)


def test_store_cache_stays_bounded(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "run", 400, seed=4)
    store = Store([Run("run", str(folder), set())], cache_entries=8, cache_bytes=20_000)
    store.compact("run", str(tmp_path / "cache"))
    first = store.list_page({"step": ["1:2"]}, None, 0, 10, None, None)
    for lo in range(60):  # 60 distinct filters, each with its count and histogram cached
        store.list_page({"reward": [f"{lo / 100}:"]}, None, 0, 10, "-reward", None)
        assert len(store.cache) <= 8 and store.cache.bytes <= 20_000
    assert store.cache.evicted > 0
    assert store.list_page({"step": ["1:2"]}, None, 0, 10, None, None) == first
    default = Store([Run("run", str(folder), set())])  # the README's figures
    assert (default.cache.max_entries, default.cache.max_bytes) == (512, 32 * 2**20)
    limit = default.query("SELECT current_setting('memory_limit') AS m")[0]["m"]
    assert limit == "953.6 MiB"  # 1 GB


def test_refreshes_leave_a_bounded_cache_folder(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = make_export(tmp_path / "v0", 100, seed=0)
    store = Store([Run("run", str(folder), set())])
    explorer = Explorer(store)
    for i in range(1, 6):  # a refresh (as cli._refresh_loop does): a new export, served
        fresh = make_export(tmp_path / f"v{i}", 100, seed=i)
        store.repoint("run", str(fresh))
        store.compact("run", str(cache))
        kept = os.listdir(cache / "compact")
        assert os.path.basename(store.runs["run"].data or "") in kept
        assert len(kept) <= KEEP_COMPACTED + 1
        explorer.indexes = {"run": SearchIndex(str(fresh), str(cache))}
        explorer.indexes["run"].open_or_build()
        explorer.prune_indexes(str(cache))
        kept = os.listdir(cache / "search")
        assert os.path.basename(explorer.indexes["run"].dir) in kept
        assert len(kept) <= KEEP_COMPACTED + 1
    assert explorer.handle("/api/search", {"q": ["question"]})["total"] > 0
    assert store.list_page({}, None, 0, 5, None, None)["total"] == 100
    # a copy still being written by another process is never deleted
    (cache / "compact" / "x.building").mkdir()
    assert prune_folder(str(cache / "compact"), set(), 0) and (cache / "compact" /
                                                               "x.building").exists()  # fmt: skip


def test_concurrent_requests_get_the_same_answers(stores: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _, fast, rows = stores
    ids = [r["trace_id"] for r in rows[::61]]
    alone = [fast.trajectory(None, i) for i in ids]
    pages = [fast.list_page({}, None, p, 20, "-latency_ms", None)["rows"] for p in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: fast.trajectory(None, i), ids))
        paged = list(pool.map(lambda p: fast.list_page({}, None, p, 20, "-latency_ms",
                                                       None)["rows"], range(8)))  # fmt: skip
    _same(together, alone)
    _same(paged, pages)


def test_a_closing_store_stops_its_background_work(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "run", 200, seed=5)
    store = Store([Run("run", str(folder), set())])
    store.close()  # as on Ctrl-C: the copy and the index stop at their next check
    with pytest.raises(InterruptedError):
        store.compact("run", str(tmp_path / "cache"))
    with pytest.raises(InterruptedError):
        SearchIndex(str(folder), str(tmp_path / "cache")).open_or_build(stop=store.stop)
    assert not [n for n in os.listdir(tmp_path / "cache" / "compact") if not
                n.endswith(".building")]  # fmt: skip
    again = Store([Run("run", str(folder), set())])  # the next start builds them whole
    again.compact("run", str(tmp_path / "cache"))
    assert again.trajectory(None, again.list_page({}, None, 0, 1, None, None)["rows"][0][
        "trace_id"])["turns"]  # fmt: skip
    assert SearchIndex(str(folder), str(tmp_path / "cache")).open_or_build()["docs"] > 0
