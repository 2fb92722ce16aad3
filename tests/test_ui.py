"""Trace browsing in MLflow's own UI, checked in headless Chromium against a real ``mlflow server``.

Trajectories are traced the way users trace theirs: ``tracer.init(backend="mlflow",
tracking_uri=<server>)``, ``@tracer.trace_op`` on a generate function that takes chat messages
and returns token ids (token2text decodes them), on a calculator tool and on a reward function,
``tracer.trace_attr(step=, sample_index=, rollout_n=)`` around each trajectory. The browser test
then checks what a user sees: the traces list under a ``tags.step = '2'`` filter, the reward
column, one trajectory's turns, a tool call's arguments and result, and the reward assessment.
``UPDATE_DOCS_SCREENSHOTS=1`` also writes the screenshot to docs/ui-trajectory.png.

MLflow's React UI is slow on 2 cores: waits are generous, but every wait is for specific content,
so wrong content still fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import MlflowServer, free_port, start_mlflow_server

pytest.importorskip("mlflow")
# one worker runs the module: each traced store and its server start once, not once per worker
pytestmark = [pytest.mark.xdist_group("ui"), pytest.mark.slow(seconds=90)]

PROJECT = "ui-test"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "ui-trajectory.png"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
WAIT_MS = 120_000  # first paint of MLflow's UI on a busy 2-core machine
LONG_STEP = 3  # the step whose one trajectory has a very long final reply
LONG_REASONING = "".join(f"Check {i}: partial products agree so far. " for i in range(400))

needs_chromium = pytest.mark.skipif(
    not shutil.which(CHROMIUM),
    reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install -y chromium; or CHROMIUM_PATH)",
)


# --------------------------------------------------------------------------- the traced agent
class CharTokenizer:
    """One token per character: token2text gives back exactly the generated text."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 0x110000


TOKENIZER = CharTokenizer()


@tracer.trace_op(kind="generate")
def generate(prompt_ids: list[int], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A scripted policy: asks the calculator, then answers with what it returned."""
    last = messages[-1]
    if last["role"] == "user":
        expression = last["content"].removeprefix("What is ").removesuffix("?")
        call = {"name": "calculator", "arguments": {"expression": expression}}
        text = f"Let me use the calculator.\n<tool_call>{json.dumps(call)}</tool_call>"
    else:
        reasoning = LONG_REASONING if messages[1]["content"] == "What is 97 * 89?" else ""
        text = f"{reasoning}The calculator returned {last['content']}. Final answer: \\boxed{{"
        text += f"{last['content']}}}"
    return {"response_ids": TOKENIZER.encode(text), "finish_reason": "stop"}


@tracer.trace_op(kind="tool")
def calculator(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    a, b = (int(x) for x in arguments["expression"].split(" * "))
    return {"name": name, "content": str(a * b)}


@tracer.trace_op(kind="reward")
def compute_reward(answer: str, ground_truth: int) -> dict[str, Any]:
    return {"score": 1.0 if f"\\boxed{{{ground_truth}}}" in answer else 0.0}


@tracer.trace_op(kind="trajectory")
def agent(messages: list[dict[str, Any]], ground_truth: int) -> dict[str, Any]:
    """Two turns: a tool call, then the answer; the agent loop appends to ``messages``."""
    first = generate(TOKENIZER.encode(json.dumps(messages)), messages)
    text = TOKENIZER.decode(first["response_ids"])
    content, raw_call = text.split("<tool_call>")
    call = json.loads(raw_call.removesuffix("</tool_call>"))
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
    tool_call = {"id": "call_0", "type": "function", "function": function}
    messages.append({"role": "assistant", "content": content.strip(), "tool_calls": [tool_call]})
    result = calculator(call["name"], call["arguments"])
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": result["content"]})
    second = generate(TOKENIZER.encode(json.dumps(messages)), messages)
    answer = TOKENIZER.decode(second["response_ids"])
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, **compute_reward(answer, ground_truth)}


def question(step: int, sample: int, n: int) -> tuple[int, int]:
    return (97, 89) if step == LONG_STEP else (10 * step + sample, 30 + n)


def run_agent(steps: list[int], samples: int, rollout_n: int) -> dict[tuple[int, int, int], float]:
    """Trace every (step, sample, rollout); rollout 1 is graded against a wrong truth."""
    rewards = {}
    for step in steps:
        for sample in range(samples):
            for n in range(rollout_n):
                a, b = question(step, sample, n)
                messages = [
                    {"role": "system", "content": "You are a careful assistant with a calculator."},
                    {"role": "user", "content": f"What is {a} * {b}?"},
                ]
                with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
                    out = agent(messages, a * b + n)
                rewards[(step, sample, n)] = out["score"]
    return rewards


def trace_into(uri: str, spool_dir: Path) -> dict[tuple[int, int, int], float]:
    tracer.reset()
    tracer.init(backend="mlflow", tracking_uri=uri, project_name=PROJECT,
                experiment_name="grpo", token2text=True, raise_internal_errors=True,
                spool_dir=str(spool_dir))  # fmt: skip
    tracer.register_tokenizer(TOKENIZER)
    try:
        rewards = run_agent([1, 2], samples=2, rollout_n=2)
        rewards.update(run_agent([LONG_STEP], samples=1, rollout_n=1))
        assert tracer.flush(timeout_s=120)
        assert tracer.metrics()["tracer/mlflow/exported"] == len(rewards)
    finally:
        tracer.reset()
    return rewards


@pytest.fixture(scope="module", params=["server", "bulk"])
def traced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[MlflowServer, str, dict]]:
    """A real lean ``mlflow server`` holding 9 traced trajectories (steps 1, 2: 2 samples x 2
    rollouts; step 3: one with a very long reply), sent to the server (MLflow's own writer), or
    written into its sqlite store by the bulk writer before the server starts."""
    root = tmp_path_factory.mktemp("ui-mlflow")
    rewards = None
    if request.param == "bulk":
        fell_back: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: fell_back.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("tracer").addHandler(handler)
        try:
            rewards = trace_into(f"sqlite:///{root / 'mlflow.db'}", root / "spool")
        finally:
            logging.getLogger("tracer").removeHandler(handler)
        assert not [line for line in fell_back if "bulk writer" in line], fell_back
    server = start_mlflow_server(root)
    try:
        if rewards is None:
            rewards = trace_into(server.url, root / "spool")
        yield server, server.experiment_id(PROJECT), rewards
    finally:
        server.stop(kill=True)  # the tests are over: no graceful shutdown to wait for


# --------------------------------------------------------------------------- stored attributes
def _ui_accepts(message: dict[str, Any]) -> bool:
    """MLflow's UI check (3.17, 3.18) for ``mlflow.chat.messages`` entries
    (isRawModelTraceChatMessage in model-trace-explorer): a known role, string content,
    well-formed tool calls."""
    calls = message.get("tool_calls") or []
    return (
        message.get("role") in ("system", "user", "assistant", "tool")
        and (message.get("content") is None or isinstance(message["content"], str))
        and all(
            isinstance(c.get("id"), str)
            and isinstance(c.get("function", {}).get("name"), str)
            and isinstance(c.get("function", {}).get("arguments"), str)
            for c in calls
        )
    )


def test_spans_carry_chat_messages_and_preview(traced: tuple[MlflowServer, str, dict]) -> None:
    """Read back with MLflow's client: generate spans carry the conversation in the chat shape
    the UI renders; the trace's response preview ends with the final answer, even when long."""
    from mlflow.tracking import MlflowClient

    server, exp_id, _ = traced
    client = MlflowClient(tracking_uri=server.url)
    infos = client.search_traces(locations=[exp_id], filter_string="tags.step = '2'")
    assert len(infos) == 4
    trace = client.get_trace(infos[0].info.trace_id)
    generates = [s for s in trace.data.spans if s.span_type == "CHAT_MODEL"]
    assert len(generates) == 2
    chat = generates[1].attributes["mlflow.chat.messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "assistant"]
    assert all(_ui_accepts(m) for m in chat), chat
    call = chat[2]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"])["expression"].count(" * ") == 1
    assert chat[4]["content"].startswith("The calculator returned ")
    assert trace.info.response_preview == chat[4]["content"]
    (long,) = client.search_traces(locations=[exp_id], filter_string=f"tags.step = '{LONG_STEP}'")
    preview = long.info.response_preview
    assert len(LONG_REASONING) > 10_000 and len(preview) <= 1000
    assert preview.startswith("[...] ") and preview.endswith("Final answer: \\boxed{8633}")
    full = client.get_trace(long.info.trace_id).data.spans
    reply = [s for s in full if s.span_type == "CHAT_MODEL"][1].attributes["response_text"]
    assert reply.startswith(LONG_REASONING) and reply.endswith("\\boxed{8633}")


# --------------------------------------------------------------------------- the browser
@needs_chromium
def test_trajectory_in_mlflow_ui(traced: tuple[MlflowServer, str, dict], tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    server, exp_id, rewards = traced
    step2 = {k: v for k, v in rewards.items() if k[0] == 2}
    shot = tmp_path / "ui-trajectory.png"
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            viewport={"width": 1480, "height": 1000},
            args=CHROMIUM_ARGS,
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(f"{server.url}/#/experiments/{exp_id}/traces")
            page.get_by_text("What is 97 * 89?").wait_for()
            timings["list"] = time.monotonic() - t0
            _dismiss_popups(page)  # a modal popover hides the table from ARIA roles
            rows = page.get_by_role("row").filter(has_text="What is")
            sync_api.expect(rows).to_have_count(9)

            # reward is a column of the traces list (the 'reward' feedback assessment)
            headers = page.get_by_role("columnheader").all_inner_texts()
            assert "reward" in headers, headers
            col = headers.index("reward")

            # a very long reply: the Output column shows its end, where the answer is
            long_row = rows.filter(has_text="What is 97 * 89?").get_by_role("cell")
            output = long_row.nth(headers.index("Output")).inner_text()
            assert output.endswith("Final answer: \\boxed{8633}"), output[-200:]

            # filter on the step tag, as a user does in MLflow 3.18's filter bar (its own
            # suggestions spell a tag filter so): type it, press Enter
            page.get_by_placeholder("Add a filter").click()
            page.keyboard.type("tag.step = '2'")
            page.keyboard.press("Enter")
            sync_api.expect(rows).to_have_count(len(step2), timeout=WAIT_MS)
            timings["filter"] = time.monotonic() - t0
            cells = [r.get_by_role("cell") for r in rows.all()]
            questions = sorted(c.nth(headers.index("Input")).inner_text() for c in cells)
            assert questions == sorted("What is {} * {}?".format(*question(*k)) for k in step2)
            shown = sorted(float(c.nth(col).inner_text()) for c in cells)
            assert shown == sorted(step2.values()), shown

            # one trajectory: its spans, turns, the tool call, the reward
            rows.filter(has_text="What is 20 * 30?").get_by_role("cell").nth(2).click()
            drawer = page.get_by_role("dialog")
            sync_api.expect(drawer.get_by_text("compute_reward")).to_be_visible()
            timings["trace"] = time.monotonic() - t0
            tree = drawer.get_by_text("generate", exact=True)
            sync_api.expect(tree).to_have_count(2)
            sync_api.expect(drawer.get_by_text("calculator", exact=True)).to_have_count(1)

            drawer.get_by_text("calculator", exact=True).click()  # the tool span
            sync_api.expect(drawer.get_by_text("20 * 30").first).to_be_visible()
            sync_api.expect(drawer.get_by_text("600").first).to_be_visible()

            # the reward: the trace's 'reward' feedback, in the root span's assessments pane
            drawer.get_by_text("trajectory", exact=True).first.click()
            drawer.get_by_role("button", name="Assess trace").click()
            sync_api.expect(drawer.get_by_text("Feedback (1)")).to_be_visible()
            text = drawer.inner_text()
            pane = text[text.index("Feedback (1)") :]
            assert re.search(r"\breward\s+1(\.0)?\s", pane), pane[:300]

            tree.nth(1).click()  # the second turn: the whole conversation so far, as chat
            for text in ["You are a careful assistant with a calculator.", "What is 20 * 30?",
                         "Let me use the calculator.", "expression", "20 * 30", "600",
                         "The calculator returned 600. Final answer: \\boxed{600}"]:  # fmt: skip
                sync_api.expect(drawer.get_by_text(text, exact=True).first).to_be_visible()
            page.wait_for_timeout(500)  # let the last pane finish rendering
            page.screenshot(path=str(shot))
            timings["screenshot"] = time.monotonic() - t0

        except BaseException:
            with contextlib.suppress(Exception):  # what the page showed, for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"))
                (tmp_path / "failure.txt").write_text(page.inner_text("body"))
                print(f"page at failure: {page.url}; see {tmp_path}/failure.png, failure.txt")
            raise
        finally:
            browser.close()
    print(f"ui timings (s since start): {timings}")
    assert shot.stat().st_size > 20_000
    if os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1":
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_PNG)


@needs_chromium
def test_mlflow_ui_sessions_and_compact_ids(
    traced: tuple[MlflowServer, str, dict], tmp_path: Path
) -> None:
    """The traces page loads without an error banner (MLflow's /graphql works), a generate
    span shows no raw token-id list, and the Sessions page lists the GRPO groups."""
    sync_api = pytest.importorskip("playwright.sync_api")
    server, exp_id, rewards = traced
    groups = {(step, sample) for step, sample, _ in rewards}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            viewport={"width": 1480, "height": 1000}, args=CHROMIUM_ARGS,
        )  # fmt: skip
        page = browser.new_page()
        page.set_default_timeout(WAIT_MS)
        try:
            page.goto(f"{server.url}/#/experiments/{exp_id}/traces")
            page.get_by_text("What is 97 * 89?").wait_for()
            _dismiss_popups(page)
            body = page.inner_text("body")
            assert "Unexpected token" not in body and "load error" not in body.lower()
            assert PROJECT in body  # the experiment's breadcrumb (from /graphql)

            rows = page.get_by_role("row").filter(has_text="What is 20 * 30?")
            rows.first.get_by_role("cell").nth(2).click()
            drawer = page.get_by_role("dialog")
            drawer.get_by_text("generate", exact=True).first.click()
            tab = drawer.get_by_role("tab", name=re.compile("Inputs"))
            if tab.count():
                tab.first.click()
            sync_api.expect(drawer.get_by_text(re.compile(r"\d+ items: \[")).first).to_be_visible()
            text = drawer.inner_text()
            assert not re.search(r"(?:\b\d{2,6},?\s*\n\s*){16}", text), "a raw id list is shown"

            # MLflow 3.17 and 3.18: the Sessions view is the traces list grouped by session
            page.goto(f"{server.url}/#/experiments/{exp_id}/traces?groupBy=session")
            for step, sample in groups:
                sync_api.expect(
                    page.get_by_text(f"grpo/step-{step}/sample-{sample}", exact=True).first
                ).to_be_visible()
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / "failure.png"))
                (tmp_path / "failure.txt").write_text(page.inner_text("body"))
                print(f"page at failure: {page.url}; see {tmp_path}/failure.png, failure.txt")
            raise
        finally:
            browser.close()


def _dismiss_popups(page: Any) -> None:
    """The 'Detect issues' popover (modal) and the assistant side panel cover the page."""
    got_it = page.get_by_role("button", name="Got it", exact=True)
    with contextlib.suppress(Exception):  # it may not show up at all
        got_it.wait_for(timeout=10_000)
        got_it.click()
        got_it.wait_for(state="detached", timeout=10_000)
    close = page.get_by_role("button", name="Close", exact=True)  # the assistant panel
    if close.count():
        close.first.click()


# --------------------------------------------------------------------------- the command
def test_ui_command_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """``rollout-tracer ui`` on a sqlite store: healthy server, Traces URL, clean Ctrl-C."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rewards = trace_into(uri, tmp_path / "spool")
    from mlflow.tracking import MlflowClient

    exp_id = MlflowClient(tracking_uri=uri).get_experiment_by_name(PROJECT).experiment_id
    port = free_port()
    # Started with SIGINT ignored, as a background job of a script is (`python -m pytest &`):
    # the ui must stop on it all the same. Left to inheritance, whether the child ignored
    # SIGINT depended on this pytest process's state (importing polars swaps an ignored SIGINT
    # for a native handler, which exec resets to default), so the test hung only in some runs.
    cmd = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh",
           sys.executable, "-m", "rollout.cli", "ui", "--tracking-uri", uri,
           "--port", str(port), "--experiment", PROJECT]  # fmt: skip
    t0 = time.monotonic()
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        "PYTHONFAULTHANDLER": "1",  # a SIGABRT prints every thread's stack (see _stuck)
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("MLflow trace UI: ") or time.monotonic() - t0 > 180:
                break
        url = f"http://127.0.0.1:{port}/#/experiments/{exp_id}/traces"
        assert f"MLflow trace UI: {url}\n" in lines, "".join(lines)[-3000:]
        started = time.monotonic() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert resp.status == 200
        body = json.dumps({"locations": [{"type": "MLFLOW_EXPERIMENT",
                                          "mlflow_experiment": {"experiment_id": exp_id}}],
                           "max_results": 50}).encode()  # fmt: skip
        search = f"http://127.0.0.1:{port}/ajax-api/3.0/mlflow/traces/search"
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(search, data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert len(json.loads(resp.read())["traces"]) == len(rewards)
        server_pids = _pids_listening_cmdline(f"--port {port}")
        assert server_pids, "mlflow server processes not found"

        t1 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(_stuck(proc, port))
        assert proc.returncode == 0, rest
        assert "mlflow server stopped" in rest
        stopped = time.monotonic() - t1
        deadline = time.monotonic() + 30  # a loaded 2-core machine reaps slowly
        while _pids_listening_cmdline(f"--port {port}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _pids_listening_cmdline(f"--port {port}"), "server processes left behind"
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        print(f"ui command: healthy after {started:.1f} s, stopped in {stopped:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _stuck(proc: subprocess.Popen[str], port: int) -> str:
    """What the command was doing when it did not stop: its threads' stacks (faulthandler on
    SIGABRT), after the server it started is killed (it holds the same output pipe)."""
    os.kill(proc.pid, signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)  # the stacks are written before the server is killed
    for pid in _pids_listening_cmdline(f"--port {port}"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        out = "(no output after SIGABRT)"
    return (f"the ui command did not stop within 60 s of Ctrl-C (exit {proc.returncode}); "
            f"its output:\n{out[-6000:]}")  # fmt: skip


def _pids_listening_cmdline(needle: str) -> list[int]:
    """PIDs whose command line contains ``needle`` (the server's unique ``--port N``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "mlflow" in cmdline and needle in cmdline:
                pids.append(int(entry.name))
    return pids


def test_ui_command_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollout.cli import main

    assert main(["ui", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "no MLflow store" in capsys.readouterr().err
