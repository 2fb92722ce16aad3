"""Arize Phoenix receives a traced multi-turn tool rollout over OTLP and reads it back.

A real ``phoenix serve`` (from its own venv, scripts/setup_phoenix.sh: Phoenix needs a
graphql-core that MLflow's graphene cannot use) runs on loopback with its own working dir and
ports and no telemetry; the tracer's ``otlp`` backend sends the spans; Phoenix's own client
(``arize-phoenix-client``) reads them back. Then headless Chromium opens the trajectory in
Phoenix's UI (``UPDATE_DOCS_SCREENSHOTS=1`` copies the screenshot to docs/).

The server comes from ``$PHOENIX_BIN``, else ``.venv-phoenix/bin/phoenix``; without either the
tests skip, unless ``PHOENIX_BIN`` is set (CI sets it): then a missing server fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests import tool_rollout
from tests._servers import _stop_group, free_port

REPO = Path(__file__).resolve().parents[1]
PHOENIX_BIN = os.environ.get("PHOENIX_BIN") or str(REPO / ".venv-phoenix" / "bin" / "phoenix")
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
DOCS_PNG = REPO / "docs" / "phoenix-trajectory.png"
PROJECT = "phoenix-test"
STARTUP_S = 300  # first start migrates a new SQLite database: ~100 s on a busy 2-core machine

if not os.path.exists(PHOENIX_BIN):
    if os.environ.get("PHOENIX_BIN"):
        raise FileNotFoundError(f"PHOENIX_BIN={PHOENIX_BIN} does not exist")
    pytest.skip(
        f"no Phoenix server at {PHOENIX_BIN}: run `bash scripts/setup_phoenix.sh`",
        allow_module_level=True,
    )
phoenix_client = pytest.importorskip("phoenix.client")

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("phoenix")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
    }
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PHOENIX_BIN, "serve"], env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"phoenix serve did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        _stop_group(proc)  # type: ignore[arg-type]


def spans_of(client: Any, want: int) -> list[dict[str, Any]]:
    """Every span of the project, once Phoenix has ingested ``want`` of them (it writes the
    OTLP batches it accepted in the background)."""
    import httpx

    deadline = time.monotonic() + 60
    spans: list[dict[str, Any]] = []
    while len(spans) < want and time.monotonic() < deadline:
        try:
            spans = client.spans.get_spans(project_identifier=PROJECT, limit=10_000)
        except httpx.HTTPStatusError as exc:  # 404 until the first span made the project
            if exc.response.status_code != 404:
                raise
        time.sleep(0.5)
    return spans


@pytest.fixture(scope="module")
def traced(phoenix: str) -> tuple[str, list[dict[str, Any]]]:
    tracer.init(
        {"backend": "otlp", "otlp_endpoint": phoenix, "project_name": PROJECT,
         "experiment_name": "grpo", "spool": False, "raise_internal_errors": True}
    )  # fmt: skip
    try:
        tool_rollout.run(step=2, samples=2, rollout_n=2)
        assert tracer.flush(timeout_s=60)
    finally:
        tracer.shutdown()
    client = phoenix_client.Client(base_url=phoenix)
    # per trajectory: the root, agent, 3 generate, 3 parse, 2 tool calls, the reward
    return phoenix, spans_of(client, 4 * 11)


def test_phoenix_reads_the_rollout(traced: tuple[str, list[dict[str, Any]]]) -> None:
    _, spans = traced
    assert len(spans) == 4 * 11
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    assert len(by_trace) == 4
    seen = set()
    for trace in by_trace.values():
        [root] = [s for s in trace if s["parent_id"] is None]
        attrs = root["attributes"]
        key = (2, int(attrs["metadata.sample_index"]), int(attrs["metadata.rollout_n"]))
        seen.add(key)
        assert root["span_kind"] == "AGENT"
        assert attrs["metadata.step"] == "2" and attrs["metadata.validate"] == "false"
        assert f"rollout_n={key[2]}" in attrs["tag.tags"]
        assert attrs["session.id"] == f"grpo/train/step-2/sample-{key[1]}"
        expected = tool_rollout.EXPECTED[key]
        assert attrs["metadata.reward"] == expected["reward"] == attrs["reward"]
        kinds = sorted(s["span_kind"] for s in trace)
        assert kinds == sorted(["AGENT", "AGENT"] + ["LLM"] * 3 + ["CHAIN"] * 3
                               + ["TOOL"] * 2 + ["EVALUATOR"])  # fmt: skip

        # each LLM span: the conversation so far, then its reply (and tool calls)
        llm = sorted((s for s in trace if s["span_kind"] == "LLM"), key=lambda s: s["start_time"])
        conversation = expected["messages"]
        for turn, span in enumerate(llm):
            a = span["attributes"]
            n_in = 2 + 2 * turn  # system, user, then (assistant, tool) per earlier turn
            for i, message in enumerate(conversation[:n_in]):
                prefix = f"llm.input_messages.{i}.message."
                assert a[prefix + "role"] == message["role"]
                assert a[prefix + "content"] == message["content"]
                for k, call in enumerate(message.get("tool_calls", [])):
                    c = f"{prefix}tool_calls.{k}.tool_call."
                    assert a[c + "function.name"] == call["function"]["name"]
                    assert a[c + "function.arguments"] == call["function"]["arguments"]
            assert f"llm.input_messages.{n_in}.message.role" not in a
            reply = conversation[n_in]
            assert a["llm.output_messages.0.message.content"].startswith(reply["content"])
            for k, call in enumerate(reply.get("tool_calls", [])):
                c = f"llm.output_messages.0.message.tool_calls.{k}.tool_call."
                assert a[c + "function.name"] == "calculator"
                assert json.loads(a[c + "function.arguments"]) == json.loads(
                    call["function"]["arguments"]
                )
            assert a["llm.token_count.completion"] == 5

        # the tool calls: arguments and results, in order
        tools = sorted(
            (s for s in trace if s["span_kind"] == "TOOL"), key=lambda s: s["start_time"]
        )
        results = [m for m in conversation if m["role"] == "tool"]
        calls = [c for m in conversation for c in m.get("tool_calls", [])]
        for span, call, result in zip(tools, calls, results, strict=True):
            # named after the tool, not the op that ran it (call_tool); tool.parameters is
            # the tool's schema, the call's values are its input
            assert span["name"] == "calculator"
            assert span["attributes"]["tool.name"] == "calculator"
            assert _nested(span["attributes"], "tool.parameters") == tool_rollout.CALCULATOR_SCHEMA
            assert json.loads(span["attributes"]["input.value"])["arguments"] == json.loads(
                call["function"]["arguments"]
            )
            assert span["attributes"]["output.value"] == result["content"]
        [reward] = [s for s in trace if s["span_kind"] == "EVALUATOR"]
        assert reward["attributes"]["reward"] == expected["reward"]
    assert seen == {(2, s, n) for s in range(2) for n in range(2)}


def _nested(attributes: dict[str, Any], prefix: str) -> Any:
    """An attribute Phoenix parsed as JSON (tool.parameters is one) and serves flattened
    (``tool.parameters.properties.expression.type``), as the object it was."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if key.startswith(prefix + "."):
            *path, last = key[len(prefix) + 1 :].split(".")
            node = out
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    return out


@pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"needs chromium at {CHROMIUM}")
def test_phoenix_ui_shows_the_trajectory(
    traced: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    url, spans = traced
    project_id = phoenix_client.Client(base_url=url).projects.get(project_name=PROJECT)["id"]
    root = next(s for s in spans if s["parent_id"] is None)
    trace_id = root["context"]["trace_id"]
    # open the trace at its second LLM call: the chat so far, with a tool call and its result
    llm = sorted(
        (s for s in spans if s["context"]["trace_id"] == trace_id and s["span_kind"] == "LLM"),
        key=lambda s: s["start_time"],
    )[1]
    shot = tmp_path / "phoenix.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(120_000)
        try:
            page.goto(
                f"{url}/projects/{project_id}/traces/{trace_id}?selectedSpanNodeId={llm['id']}"
            )
            page.get_by_text(tool_rollout.QUESTION).first.wait_for()
            page.get_by_text("Now add four.").first.wait_for()
            page.wait_for_timeout(1000)  # let the last pane finish rendering
            page.screenshot(path=str(shot))
            body = page.inner_text("body")
        finally:
            browser.close()
    assert "calculator" in body and "generate" in body
    assert shot.stat().st_size > 20_000
    if os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(shot, DOCS_PNG)
