"""The explorer's JSON API over a generated export, checked against the Parquet files read with
pyarrow, plus malformed and hostile input: every bad request gets a clear JSON error and the
server keeps answering."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("tantivy")
pq = pytest.importorskip("pyarrow.parquet")

from tests._explore import get, make_export, serving  # noqa: E402

N = 800


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("explore")
    a = make_export(root / "run-a", N, seed=1)
    b = make_export(root / "run-b", N, seed=2)
    rows = pq.read_table(a / "trajectories.parquet").to_pylist()
    with serving([("run-a", a), ("run-b", b)], root / "cache") as base:
        yield {"base": base, "rows": rows, "turns": pq.read_table(a / "turns.parquet").to_pylist(),
               "calls": pq.read_table(a / "tool_calls.parquet").to_pylist()}


def test_runs(served: dict[str, Any]) -> None:
    status, body = get(served["base"], "api/runs")
    assert status == 200
    assert [(r["name"], r["trajectories"], r["search"]) for r in body["runs"]] == [
        ("run-a", N, "ready"), ("run-b", N, "off")]  # fmt: skip
    assert all(r["compacted"] for r in body["runs"])  # the tests read the compacted copies


def test_list_filters_sorts_and_pages(served: dict[str, Any]) -> None:
    rows = served["rows"]
    want = [r for r in rows if 2 <= r["step"] <= 3 and r["reward"] >= 0.5 and not r["validate"]
            and r["num_tool_errors"] > 0]  # fmt: skip
    status, body = get(served["base"], "api/list", step="2:3", reward="0.5:", validate="false",
                       tool_errors="true", sort="-latency_ms", size=7, page=1,
                       cols="latency_ms,step")  # fmt: skip
    assert status == 200, body
    assert body["total"] == len(want)
    by_latency = sorted(want, key=lambda r: -r["latency_ms"])  # ties: in the export's order
    assert [r["trace_id"] for r in body["rows"]] == [r["trace_id"] for r in by_latency[7:14]]
    assert body["columns"] == ["trace_id", "latency_ms", "step"]
    assert sum(b["count"] for b in body["histogram"]) == len(want)
    # the bins divide the run's whole reward range: the selection's are among the run's
    whole = get(served["base"], "api/list", size=1)[1]["histogram"]
    assert {b["lo"] for b in body["histogram"]} <= {b["lo"] for b in whole}
    assert whole[0]["lo"] == min(r["reward"] for r in rows)


def test_list_other_filters(served: dict[str, Any]) -> None:
    rows, base = served["rows"], served["base"]
    cases = {
        "flag": ({"flag": "truncated"}, lambda r: "truncated" in r["flags"]),
        "finish": ({"finish_reason": "length,other"}, lambda r: r["finish_reason"] == "length"),
        "worker": ({"worker_id": "worker-3"}, lambda r: r["worker_id"] == "worker-3"),
        "kept_by": ({"kept_by": "errors"}, lambda r: r["kept_by"] == "errors"),
        "policy": ({"policy_version": "v2"}, lambda r: r["policy_version"] == "v2"),
        "generic": ({"f": ["latency_ms>1500", "prompt~question 1"]},
                    lambda r: r["latency_ms"] > 1500 and "question 1" in r["prompt"].lower()),
        "literal %": ({"f": "prompt~100%"}, lambda r: "100%" in r["prompt"]),
    }
    for name, (params, keep) in cases.items():
        status, body = get(base, "api/list", size=1, **params)
        assert status == 200, (name, body)
        assert body["total"] == sum(1 for r in rows if keep(r)), name


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"f": "reward = 1; DROP TABLE r0_trajectories"}, "not a number"),
        ({"f": "reward; DELETE FROM x"}, "is not COLUMN OP VALUE"),
        ({"f": "nonexistent > 1"}, "unknown column 'nonexistent'"),
        ({"f": "1=1 OR trace_id != ''"}, "is not COLUMN OP VALUE"),
        ({"sort": "reward; DROP TABLE x"}, "unknown column"),
        ({"sort": "(SELECT 1)"}, "unknown column"),
        ({"cols": "trace_id,secret_col"}, "unknown column 'secret_col'"),
        ({"step": "1:' OR '1'='1"}, "not a whole number"),
        ({"step": "9" * 40}, "out of the int64 range"),
        ({"reward": "nan"}, "not a finite number"),
        ({"reward": "1e999:"}, "not a finite number"),
        ({"validate": "maybe"}, "not true or false"),
        ({"size": "100000"}, "out of range"),
        ({"page": "-1"}, "out of range"),
        ({"worker_id": "x" * 5000}, "longer than 1000"),
        ({"f": ["step>1"] * 40}, "too many filters"),
        ({"drop": "table"}, "unknown parameter 'drop'"),
        ({"run": "nope"}, "unknown run 'nope'"),
    ],
)
def test_hostile_and_malformed_filters(served: dict[str, Any], params: dict[str, Any],
                                       message: str) -> None:  # fmt: skip
    status, body = get(served["base"], "api/list", **params)
    assert status in (400, 404), body
    assert message in body["error"]
    # the server keeps serving, and the table is still there
    assert get(served["base"], "api/list", size=1)[1]["total"] == N


def test_search_finds_and_highlights(served: dict[str, Any]) -> None:
    status, body = get(served["base"], "api/search", q="timeout", **{"in": "result"}, size=5)
    assert status == 200, body
    want = {(c["trace_id"], c["call_index"]) for c in served["calls"] if c["error"]}
    assert body["total"] == len(want)
    for hit in body["hits"]:
        assert (hit["trace_id"], hit["index"]) in want
        a, b = hit["highlighted"][0]
        assert hit["fragment"][a:b].lower() == "timeout"
    question = served["rows"][0]["prompt"].split(":")[0]  # "Question <k>"
    status, body = get(served["base"], "api/search", q=f'"{question}"', **{"in": "prompt"})
    assert status == 200 and body["total"] >= 1
    assert all(question in h["fragment"] for h in body["hits"])
    for bad, msg in [('"unclosed', "cannot parse"), ("", "give the words"), ("x" * 600, "longer"),
                     ("nofield:word", "cannot parse")]:  # fmt: skip
        status, body = get(served["base"], "api/search", q=bad)
        assert status == 400 and msg in body["error"], (bad, body)
    status, body = get(served["base"], "api/search", q="timeout", **{"in": "secrets"})
    assert status == 400 and "not one of" in body["error"]


def test_one_trajectory(served: dict[str, Any]) -> None:
    row = served["rows"][5]
    status, body = get(served["base"], "api/trajectory", id=row["trace_id"])
    assert status == 200, body
    assert body["trajectory"]["reward"] == row["reward"]
    turns = [t for t in served["turns"] if t["trace_id"] == row["trace_id"]]
    assert [t["response_text"] for t in body["turns"]] == [t["response_text"] for t in turns]
    assert len(body["tool_calls"]) == 3
    assert sorted(body["tokens"]) == ["0", "1", "2"] and len(body["tokens"]["0"]) == 4
    assert set(body["scales"]) == {"rollout_logprob", "mismatch_kl", "ref_kl", "entropy"}
    assert get(served["base"], "api/trajectory", id="0" * 32)[0] == 404
    status, body = get(served["base"], "api/trajectory", id="'; DROP TABLE x; --")
    assert status == 400 and "not a trace id" in body["error"]
    assert get(served["base"], "api/trajectory")[1]["error"] == "id: required"


def test_groups_flag_zero_variance(served: dict[str, Any]) -> None:
    step = 2
    groups: dict[str, list[float]] = {}
    for r in served["rows"]:
        if r["step"] == step and not r["validate"]:
            groups.setdefault(r["sample_key"], []).append(r["reward"])
    zero = {k for k, v in groups.items() if len(v) > 1 and min(v) == max(v)}
    status, body = get(served["base"], "api/groups", step=step, size=200)
    assert status == 200, body
    assert body["total"] == len(groups) and body["zero_variance"] == len(zero)
    assert {g["sample_key"] for g in body["groups"] if g["zero_variance"]} == zero
    g = next(g for g in body["groups"] if not g["zero_variance"])
    assert abs(sum(r["advantage"] for r in g["rollouts"])) < 1e-6  # GRPO: advantages sum to 0
    status, body = get(served["base"], "api/groups", step=step, zero="true")
    assert body["total"] == len(zero)
    assert get(served["base"], "api/groups")[0] == 400


def test_one_group_side_by_side(served: dict[str, Any]) -> None:
    rows, turns = served["rows"], served["turns"]
    row = next(r for r in rows if r["step"] == 2 and not r["validate"])
    mates = sorted((r for r in rows if r["step"] == 2 and not r["validate"]
                    and r["sample_key"] == row["sample_key"]), key=lambda r: r["rollout_n"])
    status, body = get(served["base"], "api/group", step=2, sample=row["sample_key"])
    assert status == 200, body
    assert [r["trace_id"] for r in body["rollouts"]] == [r["trace_id"] for r in mates]
    assert [r["reward"] for r in body["rollouts"]] == [r["reward"] for r in mates]
    assert abs(sum(r["advantage"] for r in body["rollouts"])) < 1e-6
    best = max(mates, key=lambda r: r["reward"])  # the first of the best: max keeps it
    assert body["base"] == best["rollout_n"] and body["prompt"] == row["prompt"]
    for r in body["rollouts"]:
        mine = [t["response_text"] for t in turns if t["trace_id"] == r["trace_id"]]
        assert r["text"] == "\n\n".join(mine)  # every turn's words
        if r["rollout_n"] == body["base"]:
            assert r["diff"] is None
        else:  # the diff rebuilds both texts
            assert "".join(t for op, t in r["diff"] if op != "-") == r["text"]
            base = next(x for x in body["rollouts"] if x["rollout_n"] == body["base"])
            assert "".join(t for op, t in r["diff"] if op != "+") == base["text"]
    assert get(served["base"], "api/group", step=2, sample="no-such")[0] == 404
    assert get(served["base"], "api/group", sample=row["sample_key"])[0] == 400


def test_prompt_across_steps_with_diff(served: dict[str, Any]) -> None:
    row = served["rows"][0]
    same = [r for r in served["rows"] if r["prompt"] == row["prompt"]]
    status, body = get(served["base"], "api/prompt", id=row["trace_id"])
    assert status == 200, body
    assert sum(len(s["rollouts"]) for s in body["steps"]) == len(same)
    assert len({(r["step"], r["validate"]) for r in same}) == len(body["steps"]) >= 2
    second = body["steps"][1]
    new = "".join(t for op, t in second["diff"] if op != "-")
    assert new == second["rollouts"][0]["response_text"]  # the diff rebuilds the new text
    assert get(served["base"], "api/prompt")[0] == 400


def test_steps_and_compare(served: dict[str, Any]) -> None:
    status, body = get(served["base"], "api/steps")
    train = [s for s in body["steps"] if not s["validate"]]
    rows = [r for r in served["rows"] if r["step"] == 1 and not r["validate"]]
    assert train[0]["n"] == len(rows)
    assert abs(train[0]["reward"] - sum(r["reward"] for r in rows) / len(rows)) < 1e-9
    row = served["rows"][0]
    status, body = get(served["base"], "api/compare", id=row["trace_id"])
    assert status == 200, body
    assert [r["run"] for r in body["runs"]] == ["run-a", "run-b"]
    assert body["runs"][1]["diff"] is not None  # the same prompt at the same step in run-b


def test_read_only_and_unknown_endpoints(served: dict[str, Any]) -> None:
    req = urllib.request.Request(served["base"] + "api/list", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 405
    status, body = get(served["base"], "api/../../etc/passwd")
    assert status == 404 and "no endpoint" in body["error"]
    with urllib.request.urlopen(served["base"], timeout=30) as r:
        html = r.read().decode()
    assert "<script>" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "no network resources"
    assert "fetch(\"http" not in html and "import " not in html



def _raw(base: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    """GET with these headers exactly (``Host`` included, which urllib would set itself)."""
    import http.client
    import json
    from urllib.parse import urlparse

    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest("GET", "/" + path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if path.startswith("api/") else body
    finally:
        conn.close()


def test_only_this_machines_names_are_answered(served: dict[str, Any]) -> None:
    """DNS rebinding: a page on attacker.example whose name now points at 127.0.0.1 sends its
    own name as Host, and a cross-site fetch carries its Origin: both are refused."""
    base = served["base"]
    port = base.rsplit(":", 1)[1].strip("/")
    for host in ("127.0.0.1", "localhost", "[::1]", "LOCALHOST"):
        for h in (f"{host}:{port}", host):
            status, body = _raw(base, "api/list?size=1", {"Host": h})
            assert status == 200 and body["total"] == N, (h, body)
    for host in (f"attacker.example:{port}", "attacker.example", "127.0.0.1.attacker.example",
                 f"192.168.1.7:{port}", ""):  # fmt: skip
        status, body = _raw(base, "api/list?size=1", {"Host": host})
        assert status == 403 and "is not one this explorer serves" in body["error"], host
        assert "rows" not in body
    status, page = _raw(base, "", {"Host": f"attacker.example:{port}"})
    assert status == 403 and b"<script>" not in page  # not even the page
    assert _raw(base, "api/list?size=1", {})[0] == 403  # HTTP/1.0 without a Host
    own = {"Host": f"127.0.0.1:{port}"}
    assert _raw(base, "api/list?size=1", {**own, "Origin": f"http://127.0.0.1:{port}"})[0] == 200
    for origin in ("http://attacker.example", f"http://localhost:{port}", "null",
                   f"https://127.0.0.1:{port}", f"http://127.0.0.1:{int(port) + 1}"):  # fmt: skip
        status, body = _raw(base, "api/list?size=1", {**own, "Origin": origin})
        assert status == 403 and "is not this explorer's" in body["error"], origin


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine (the Host "
                    "[::1] is checked over 127.0.0.1 above)")  # fmt: skip
def test_served_on_ipv6_loopback(tmp_path: Any) -> None:
    folder = make_export(tmp_path / "run", 20, seed=4)
    with serving([("run", folder)], tmp_path / "cache", search=0, host="::1") as base:
        assert base.startswith("http://[::1]:")
        status, body = get(base, "api/list", size=1)
        assert status == 200 and body["total"] == 20
        port = base.rsplit(":", 1)[1].strip("/")
        assert _raw(base, "api/list?size=1", {"Host": f"evil.example:{port}"})[0] == 403


def test_a_network_host_needs_allow_host(tmp_path: Any) -> None:
    import subprocess
    import sys

    folder = make_export(tmp_path / "run", 10, seed=4)
    # a subprocess with a deadline: were the check gone, the command would serve forever
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "explore", "--from", "parquet",
                           "--path", str(folder), "--host", "0.0.0.0", "--port", "0",
                           "--no-search", "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "readable by anyone on the network" in done.stderr
    assert "needs --allow-host NAME" in done.stderr
    assert "Traceback" not in done.stderr and "http://" not in done.stdout


def test_allow_host_adds_names(tmp_path: Any) -> None:
    from tracer.readers.explore.server import Explorer, make_server, serve_in_thread
    from tracer.readers.explore.store import Run, Store

    folder = make_export(tmp_path / "run", 10, seed=4)
    server = make_server(Explorer(Store([Run("run", str(folder), set())])), "127.0.0.1", 0,
                         allow_hosts=("mybox.lan",))  # fmt: skip
    serve_in_thread(server)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        assert _raw(base, "api/list?size=1", {"Host": "mybox.lan:1"})[0] == 200
        assert _raw(base, "api/list?size=1", {"Host": "otherbox.lan"})[0] == 403
    finally:
        server.shutdown()
        server.server_close()
