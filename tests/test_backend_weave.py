"""Weave backend through the real WeaveClient (weave==0.54.0).

The Weave cloud cannot be reached from here (and weave ships no local server), so the client
talks to ``InProcessWeaveServer`` (tests/_servers.py), which implements weave's trace-server
interface in-process and keeps what it received.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

import tracer
from tests._servers import InProcessWeaveServer

weave = pytest.importorskip("weave")

from tracer.backends import weave_backend  # noqa: E402


@tracer.trace_op(kind="generate")
def generate(messages: list[dict[str, Any]], model: str = "toy") -> dict[str, Any]:
    return {"content": "CALL add 2 3", "finish_reason": "stop"}


@tracer.trace_op(kind="parse")
def parse(text: str) -> list[dict[str, Any]]:
    return [{"name": "add", "arguments": {"a": 2, "b": 3}}]


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any], tool_call_id: str) -> str:
    if name != "add":
        raise KeyError(name)
    return str(arguments["a"] + arguments["b"])


@tracer.trace_op(kind="reward")
def compute_reward(answer: str) -> dict[str, float]:
    return {"score": 1.0 if answer == "5" else 0.0}


def run_rollout(step: int, sample_index: int, rollout_n: int) -> None:
    with tracer.trace_attr(step=step, sample_index=sample_index, rollout_n=rollout_n):
        messages = [{"role": "user", "content": "2+3?"}]
        out = generate(messages)
        calls = parse(out["content"])
        answer = call_tool(calls[0]["name"], calls[0]["arguments"], tool_call_id="call_0")
        with pytest.raises(KeyError):
            call_tool("mul", {}, tool_call_id="call_1")
        compute_reward(answer)


def test_trajectories_become_weave_call_trees(weave_server: InProcessWeaveServer) -> None:
    tracer.init(
        {
            "backend": "weave",
            "project_name": "weave-tests",
            "weave_entity": "team",
            "experiment_name": "grpo",
            "raise_internal_errors": True,
        }
    )
    run_rollout(step=1, sample_index=0, rollout_n=0)
    run_rollout(step=1, sample_index=1, rollout_n=1)
    assert tracer.flush(timeout_s=30)
    assert tracer.metrics()["tracer/weave/exported"] == 2

    calls = weave_server.calls()
    assert len(calls) == 2 * 6
    assert all(c["project_id"] == "team/weave-tests" for c in calls)
    assert all(c["ended_at"] is not None for c in calls)
    roots = [c for c in calls if c["parent_id"] is None]
    assert len(roots) == 2
    by_id = {c["id"]: c for c in calls}
    for root in roots:
        assert root["trace_id"] == root["id"]
        uuid.UUID(root["id"])  # Weave call ids are UUIDs
        attrs = root["attributes"]
        assert attrs["kind"] == "trajectory"
        assert attrs["step"] == 1
        assert attrs["rollout_n"] == attrs["sample_index"]
        assert attrs["validate"] is False
        assert attrs["attempt"] == 0
        assert attrs["experiment_name"] == "grpo"
        assert attrs["worker_id"] == tracer.get_tracer().config.worker_id
        assert root["output"]["reward"] == 1.0
        assert root["summary"]["reward"] == 1.0
        # the client sends calls from a thread pool: order them by their recorded start
        children = sorted(
            (c for c in calls if c["parent_id"] == root["id"]), key=lambda c: c["started_at"]
        )
        assert all(c["trace_id"] == root["id"] for c in children)
        assert sorted(c["display_name"] for c in children) == [
            "call_tool",
            "call_tool",
            "compute_reward",
            "generate",
            "parse",
        ]
        kinds = {c["display_name"]: c["attributes"]["kind"] for c in children}
        assert kinds == {
            "generate": "generate",
            "parse": "parse",
            "call_tool": "tool",
            "compute_reward": "reward",
        }
        named = {c["display_name"]: c for c in children}
        gen, reward = named["generate"], named["compute_reward"]
        tools = {
            c["inputs"]["tool_call_id"]: c for c in children if c["display_name"] == "call_tool"
        }
        tool_ok, tool_err = tools["call_0"], tools["call_1"]
        assert root["inputs"] == gen["inputs"]  # the root shows the first op's inputs
        assert gen["inputs"]["messages"] == [{"role": "user", "content": "2+3?"}]
        assert gen["output"]["content"] == "CALL add 2 3"
        assert gen["attributes"]["finish_reason"] == "stop"
        assert tool_ok["inputs"]["arguments"] == {"a": 2, "b": 3}
        assert tool_ok["output"] == "5"
        assert tool_ok["attributes"]["tool_name"] == "add"
        assert tool_ok["exception"] is None
        assert json.loads(tool_err["exception"])["type"] == "KeyError"
        assert reward["output"] == {"score": 1.0}
        assert reward["attributes"]["reward"] == 1.0
        # explicit timestamps from the record, not export time
        assert gen["started_at"] >= root["started_at"] and gen["ended_at"] <= root["ended_at"]
        assert root["ended_at"] is not None
        assert all(c["id"] in by_id for c in children)
    # ops were saved through obj_create, not via weave.op on the hot path
    assert {o["object_id"] for o in weave_server.objs} >= {"trajectory", "generate"}


def test_reexport_is_idempotent(weave_server: InProcessWeaveServer) -> None:
    tracer.init({"backend": ["weave", "memory"], "raise_internal_errors": True})
    run_rollout(step=2, sample_index=0, rollout_n=0)
    assert tracer.flush(timeout_s=30)
    from tracer.testing import InMemoryExporter

    [record] = InMemoryExporter.latest().records
    exporter = weave_backend.WeaveExporter(tracer.get_tracer().config)
    n = len(weave_server.starts)
    exporter.export([record])
    exporter.export([record])  # same process: sent once
    ids = [s["id"] for s in weave_server.starts[n:]]
    assert sorted(ids) == sorted(s["id"] for s in weave_server.starts[:n])  # same call ids


@pytest.mark.parametrize("users_client", [False, True], ids=["no-global", "users-global"])
def test_the_users_global_weave_client_is_left_alone(
    weave_server: InProcessWeaveServer, users_client: bool
) -> None:
    from weave.trace.context.weave_client_context import (
        get_weave_client,
        set_weave_client_global,
    )
    from weave.trace.weave_client import WeaveClient

    assert get_weave_client() is None
    users_server = InProcessWeaveServer()
    user = None
    if users_client:  # as after the user's own weave.init("me/mine")
        user = WeaveClient("me", "mine", users_server, ensure_project_exists=False)
        set_weave_client_global(user)

    @weave.op
    def users_op(x: int) -> int:
        return x + 1

    try:
        tracer.init({"backend": "weave", "project_name": "weave-tests", "weave_entity": "team",
                     "raise_internal_errors": True})  # fmt: skip
        assert get_weave_client() is user
        run_rollout(step=1, sample_index=0, rollout_n=0)
        assert tracer.flush(timeout_s=30)
        assert get_weave_client() is user
        # the user's own op goes to the user's project, or nowhere without weave.init
        assert users_op(1) == 2
        if user is not None:
            user.flush()
        tracer.shutdown()
        assert get_weave_client() is user

        calls = weave_server.calls()
        assert len(calls) == 6 and all(c["project_id"] == "team/weave-tests" for c in calls)
        assert all(c["ended_at"] is not None for c in calls)
        users_calls = users_server.calls()
        assert [c["project_id"] for c in users_calls] == (["me/mine"] if users_client else [])
    finally:
        set_weave_client_global(None)


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_weave_disabled_fails_the_export_instead_of_dropping_it(
    weave_server: InProcessWeaveServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("WEAVE_DISABLED", "true")
    # shutdown_timeout_s: it never recovers; the teardown gives up after 1 s instead of 10
    tracer.init({"backend": "weave", "project_name": "weave-tests", "export_max_retries": 1,
                 "spool_dir": str(tmp_path / "spool"), "shutdown_timeout_s": 1})  # fmt: skip
    run_rollout(step=1, sample_index=0, rollout_n=0)
    assert not tracer.flush(timeout_s=3)  # not stored: the batch waits in the spool
    assert weave_server.calls() == []
    assert tracer.metrics().get("tracer/weave/exported", 0) == 0


def test_missing_api_key_is_a_clear_init_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", "/nonexistent")
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")
    monkeypatch.setenv("HOME", "/nonexistent")
    with pytest.raises(tracer.TracerInitError, match="WANDB_API_KEY"):
        tracer.init({"backend": "weave", "project_name": "p"})


def test_unreachable_server_warns_and_others_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WF_TRACE_SERVER_URL", "http://127.0.0.1:9")  # discard port: refused
    t = tracer.init(
        {"backend": ["weave", "memory"], "on_backend_error": "warn", "raise_internal_errors": True}
    )
    assert "WF_TRACE_SERVER_URL" in caplog.text
    run_rollout(step=3, sample_index=0, rollout_n=0)
    assert tracer.flush(timeout_s=30)
    assert t.metrics()["tracer/memory/exported"] == 1
    assert "tracer/weave/exported" not in t.metrics()
