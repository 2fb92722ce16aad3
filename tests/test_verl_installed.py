"""An installed, unmodified verl 0.9.1 switched to rollout-tracer by ``ROLLOUT_TRACER_VERL=1``.

Runs in the venv made by ``scripts/setup_verl_cpu.sh`` (verl pins transformers<5.11)::

    bash scripts/setup_verl_cpu.sh
    .venv-verl/bin/python -m pytest -q tests/test_verl_installed.py -m verl_installed

Elsewhere every test here skips (verl is not importable). verl's own ``AgentLoopWorker`` runs
in a local Ray worker with its own ``ToolAgentLoop`` and ``SingleTurnAgentLoop``, its own
``LLMServerClient`` and load balancer; only vLLM's server is replaced, by SmolLM2 on CPU
(tests/verl_cpu.py). The switch reaches the worker through Ray's ``runtime_env`` alone: this
pytest process does not have it set. What was traced is read back with MLflow's client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup_verl_cpu.sh only")
ray = pytest.importorskip("ray")
mlflow = pytest.importorskip("mlflow")

from tests import verl_cpu  # noqa: E402

pytestmark = [pytest.mark.verl_installed, pytest.mark.slow]

VERL_TRACED_FILES = (
    "verl/utils/rollout_trace.py", "verl/experimental/agent_loop/agent_loop.py",
    "verl/experimental/agent_loop/tool_agent_loop.py",
    "verl/experimental/agent_loop/single_turn_agent_loop.py",
    "verl/experimental/agent_loop/tool_parser.py", "verl/tools/base_tool.py",
    "verl/workers/rollout/llm_server.py",
)  # fmt: skip
PROJECT_ON, PROJECT_OFF = "verl-math-switched", "verl-math-verl-own"
TRAIN_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
                  "logprobs": False}  # fmt: skip
VAL_SAMPLING = {**TRAIN_SAMPLING, "temperature": 0, "top_p": 1.0}  # verl's val_kwargs
ENV = {"MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "true",
       "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}  # fmt: skip


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter of this venv (its .pth lines run at start), outside the repo so
    the installed rollout-tracer is the one imported."""
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROLLOUT_TRACER_VERL")}
    return subprocess.run([sys.executable, "-c", code], env={**full, **ENV, **env}, cwd="/",
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_verl_files_match_the_wheel_and_the_switch_is_a_pth_of_ours() -> None:
    checked, changed = verl_cpu.verl_record_hashes()
    assert changed == [] and len(checked) > 300
    # among them, every file that imports verl.utils.rollout_trace, and that module itself
    assert set(VERL_TRACED_FILES) <= set(checked)
    import sysconfig
    from importlib.metadata import distributions

    # the installed wheel (not the repo's egg-info that pytest's pythonpath also sees)
    site = sysconfig.get_paths()["purelib"]
    ours, = (d for d in distributions(path=[site]) if d.metadata["Name"] == "rollout-tracer")
    files = [str(f) for f in ours.files or []]
    assert "rollout_tracer_verl.pth" in files and "tracer/verl_switch.py" in files
    assert not any(f.startswith("__editable__") for f in files)  # a real, non-editable install
    assert Path(site, "rollout_tracer_verl.pth").read_text() == (
        Path(__file__).parents[1] / "tracer" / "rollout_tracer_verl.pth").read_text()


def test_the_setting_decides_which_module_verl_imports() -> None:
    code = ("import verl.utils.rollout_trace as m, verl.experimental.agent_loop.agent_loop as a;"
            "print(getattr(m, '__rollout_tracer__', False), a.RolloutTraceConfig.__module__,"
            "type(a.rollout_trace_attr(trace=False)).__module__)")  # fmt: skip
    on = _python(code, ROLLOUT_TRACER_VERL="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["True", "verl.utils.rollout_trace", "tracer.scope"]  # ours
    off = _python(code)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "verl.utils.rollout_trace", "contextlib"]


def test_when_our_side_cannot_load_verl_keeps_its_own_tracer() -> None:
    # rollout-tracer's verl layer fails to import: verl's module, one warning, the job starts
    code = ("import sys, tracer; del tracer.verl_compat; sys.modules['tracer.verl_compat'] = None\n"
            "import verl.utils.rollout_trace as m\n"
            "print(getattr(m, '__rollout_tracer__', False), m.rollout_trace_op.__module__)")
    cut = _python(code, ROLLOUT_TRACER_VERL="1")
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.split() == ["False", "verl.utils.rollout_trace"]
    assert cut.stderr.count("could not load") == 1

    # rollout-tracer itself cannot be imported when the .pth line runs (here: a broken
    # `tracer` package first on the path): one warning at start, verl's module, no traceback
    broken = Path(os.environ.get("TMPDIR", "/tmp")) / f"broken-tracer-{os.getpid()}" / "tracer"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "__init__.py").write_text("raise ImportError('half-installed')\n")
    start = _python("import verl.utils.rollout_trace as m; "
                    "print(getattr(m, '__rollout_tracer__', False))",
                    ROLLOUT_TRACER_VERL="1", PYTHONPATH=str(broken.parent))  # fmt: skip
    assert start.returncode == 0, start.stderr
    assert start.stdout.split() == ["False"]
    # the same line each time site reads the .pth (twice in a Python 3.11 venv: site.venv()
    # and site.main() both process site-packages), and nothing else
    lines = start.stderr.splitlines()
    warned = [x for x in lines if "could not load (ImportError: half-installed)" in x]
    assert warned and set(warned) == {
        "rollout-tracer: WARNING: ROLLOUT_TRACER_VERL is set but rollout-tracer could not load "
        "(ImportError: half-installed); verl traces with its own tracer"}
    assert "Traceback" not in start.stderr

    # its init fails (a typo in an option): verl's own tracer takes over and traces the ops
    code = (
        "import asyncio, sys, mlflow\n"
        "from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, "
        "rollout_trace_op\n"
        "class Loop:\n"
        "    @rollout_trace_op\n"
        "    async def run(self, x):\n"
        "        return x + 1\n"
        "RolloutTraceConfig.init('fallback', 'e1', 'mlflow', False, None)\n"
        "async def main():\n"
        "    with rollout_trace_attr(sample_index=0, step=3, name='agent_loop'):\n"
        "        return await Loop().run(1)\n"
        "print(asyncio.run(main()), RolloutTraceConfig.get_instance().backend)\n"
        "mlflow.flush_trace_async_logging()\n"
        "exp = mlflow.get_experiment_by_name('fallback')\n"
        "t, = mlflow.search_traces(locations=[exp.experiment_id], return_type='list')\n"
        "print(sorted(s.name for s in t.data.spans), t.info.tags.get('tracer'), "
        "t.info.tags['step'])\n"
        # an unknown backend: rollout-tracer refuses it, verl's tracer takes it and traces
        # nothing, as verl does
        "import os; os.environ.pop('ROLLOUT_TRACER_SPOL_DIR')\n"
        "RolloutTraceConfig.reset(); RolloutTraceConfig.init('p', 'e', 'mlfow')\n"
        "print(RolloutTraceConfig.get_backend(), RolloutTraceConfig.get_client(), "
        "'verl.utils._rollout_trace_verl_own' in sys.modules)\n"
    )
    db = f"sqlite:///{Path(os.environ.get('TMPDIR', '/tmp')) / f'fallback-{os.getpid()}.db'}"
    bad = _python(code, ROLLOUT_TRACER_VERL="1", ROLLOUT_TRACER_SPOL_DIR="/x",
                  MLFLOW_TRACKING_URI=db)  # fmt: skip
    assert bad.returncode == 0, bad.stderr
    first, second, third = bad.stdout.strip().splitlines()[-3:]
    assert first == "2 mlflow"
    assert second == "['Loop.run', 'agent_loop'] None 3"  # verl's trace: no tracer tag
    assert third == "mlfow None True"
    assert "did you mean `ROLLOUT_TRACER_SPOOL_DIR`" in bad.stderr  # the warning says the fix
    assert "unknown trace backend(s) ['mlfow']" in bad.stderr
    assert bad.stderr.count("verl traces with its own tracer") == 2


def test_verl_dump_written_by_verl_reads_back(tmp_path: Path) -> None:
    from rollout.models import load_tokenizer
    from tracer.readers import iter_records

    tok = load_tokenizer(verl_cpu.MODEL)
    for step in (1, 2):
        verl_cpu.write_verl_dump(str(tmp_path), step, tok)
    fixture = Path(__file__).parent / "data" / "verl_dump"
    for name in ("1.jsonl", "2.jsonl"):  # the committed fixture is what verl writes today
        assert (tmp_path / name).read_text() == (fixture / name).read_text()
    records = [r for page in iter_records("verl-dump", path=str(tmp_path)) for r in page]
    assert [(r.step, r.reward) for r in records] == [(1, 1.0), (1, 0.0), (2, 1.0), (2, 0.0)]


# --------------------------------------------------------- verl's agent loops in Ray workers
@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One local Ray cluster; the switch and the store reach workers by runtime_env only."""
    from ray import cloudpickle

    assert os.environ.get("ROLLOUT_TRACER_VERL") is None  # only the workers get it
    tmp = tmp_path_factory.mktemp("verl-ray")
    uri_on, uri_off = f"sqlite:///{tmp / 'on.db'}", f"sqlite:///{tmp / 'off.db'}"
    cloudpickle.register_pickle_by_value(verl_cpu)  # the server class travels by value
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ENV})  # fmt: skip
    try:
        yield run_loops(tmp, uri_on, uri_off)
    finally:
        ray.shutdown()


def run_loops(tmp: Path, uri_on: str, uri_off: str) -> dict[str, Any]:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    tools = verl_cpu.write_tool_config(tmp / "tools.yaml")
    server = ray.remote(verl_cpu.CpuLLMServer).options(num_cpus=1).remote(
        96, [verl_cpu.TOOL_SCHEMA])  # fmt: skip
    balancer = get_router_handle({"cpu-0": server})
    out: dict[str, Any] = {"uri_on": uri_on, "uri_off": uri_off, "server": server}
    for switch, project, uri in (("1", PROJECT_ON, uri_on), ("0", PROJECT_OFF, uri_off)):
        trace = {"backend": "mlflow", "token2text": True, "project_name": project,
                 "experiment_name": "grpo-cpu", "max_samples_per_step_per_worker": None}
        config = verl_cpu.verl_config(trace, tools)
        env = {**ENV, "ROLLOUT_TRACER_VERL": switch, "MLFLOW_TRACKING_URI": uri,
               "ROLLOUT_TRACER_SPOOL_DIR": str(tmp / f"spool-{switch}")}  # fmt: skip
        if switch == "0":  # verl's own tracer: MLflow's async queue (10 threads) may drop or
            env["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"  # reorder; the test wants its traces
        client = LLMServerClient(config, balancer)
        worker = ray.remote(AgentLoopWorker).options(
            num_cpus=1, runtime_env={"env_vars": env}).remote(config, client)  # fmt: skip
        batches = [verl_cpu.math_batch("tool_agent", 1, False),
                   verl_cpu.math_batch("single_turn_agent", 1, True)]  # fmt: skip
        before = len(ray.get(server.sampling_received.remote()))
        results = [ray.get(worker.generate_sequences.remote(b), timeout=600) for b in batches]
        received = ray.get(server.sampling_received.remote())[before:]
        out[switch] = {"worker": worker, "results": results, "received": received}
    out["session"] = ray._private.worker._global_node.get_session_dir_path()
    return out


def _has_root(trace: Any) -> bool:
    return any(s.parent_id is None for s in trace.data.spans)


def _traces(uri: str, project: str, expected: int, timeout_s: float = 120,
            complete: Callable[[Any], bool] = _has_root) -> list[Any]:
    """Traces of ``project`` once ``expected`` complete ones (with their root span) are
    there: both tracers export in the background, rollout-tracer within its flush interval,
    verl's MLflow asynchronously and span by span (a trace can be seen before its root, and
    a root before a child written by another of its queue's threads)."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    deadline = time.monotonic() + timeout_s
    while True:
        exp = client.get_experiment_by_name(project)
        found = client.search_traces(locations=[exp.experiment_id]) if exp else []
        traces = [client.get_trace(t.info.trace_id) for t in found]
        done = [t for t in traces if complete(t)]
        if len(done) >= expected or time.monotonic() > deadline:
            return traces
        time.sleep(1)


def _by_name(trace: Any) -> dict[str, list[Any]]:
    spans: dict[str, list[Any]] = {}
    for span in trace.data.spans:
        spans.setdefault(span.name, []).append(span)
    return spans


def test_switched_verl_agent_loops_write_our_traces(ray_run: dict[str, Any]) -> None:
    traces = _traces(ray_run["uri_on"], PROJECT_ON, 4)
    assert len(traces) == 4
    tool_traces = []
    for trace in traces:
        tags = trace.info.tags
        assert tags["tracer"] == "rollout-tracer"  # how users see the switch took effect
        assert (tags["step"], tags["rollout_n"], tags["experiment_name"]) == ("1", "0", "grpo-cpu")
        assert tags["sample_index"] in ("0", "1")
        spans = _by_name(trace)
        root = next(s for s in trace.data.spans if s.parent_id is None)
        assert root.name == "agent_loop"  # verl's rollout_trace_attr(name="agent_loop")
        validate = tags["validate"]
        loop = "SingleTurnAgentLoop.run" if validate == "True" else "ToolAgentLoop.run"
        assert validate in ("True", "False") and loop in spans
        sampling = VAL_SAMPLING if validate == "True" else TRAIN_SAMPLING
        for gen in spans["LLMServerClient.generate"]:
            assert gen.inputs["sampling_params"] == sampling  # what verl's loop chose
            assert "What is" in gen.outputs["prompt_text"]  # token2text, verl's output keys
            assert gen.outputs["response_text"] and gen.outputs["token_ids"]
        if "BaseTool.execute" in spans:
            tool_traces.append(spans)
    assert tool_traces, "no trajectory reached verl's tool call"
    spans = tool_traces[0]
    call = spans["BaseTool.execute"][0]
    assert call.inputs["parameters"].keys() == {"expression"}
    assert call.outputs[0]["text"] == "Updated the tool state."  # verl's BaseTool.execute
    assert len(spans["LLMServerClient.generate"]) == 2
    assert spans["HermesToolParser.extract_tool_calls"]
    # what verl sent the server, call for call, is what the traces recorded
    traced = sorted(json.dumps(g.inputs["sampling_params"], sort_keys=True)
                    for t in traces for g in _by_name(t)["LLMServerClient.generate"])  # fmt: skip
    assert traced == sorted(json.dumps(s, sort_keys=True) for s in ray_run["1"]["received"])
    logs = "".join(p.read_text(errors="replace")
                   for p in Path(ray_run["session"], "logs").glob("worker-*.err"))  # fmt: skip
    assert logs.count("rollout-tracer active for verl (backend=mlflow, project=" + PROJECT_ON) == 1


def _verl_complete(trace: Any) -> bool:
    names = {s.name for s in trace.data.spans}
    return _has_root(trace) and {"agent_loop", "LLMServerClient.generate"} <= names


def test_without_the_switch_verl_uses_its_own_tracer(ray_run: dict[str, Any]) -> None:
    traces = _traces(ray_run["uri_off"], PROJECT_OFF, 4, complete=_verl_complete)
    seen = [(t.info.tags.get("step"), sorted({s.name for s in t.data.spans})) for t in traces]
    assert len(traces) == 4, seen
    for trace in traces:
        assert "tracer" not in trace.info.tags and "worker_id" not in trace.info.tags
        assert trace.info.tags.get("step") == "1", seen
        assert _verl_complete(trace), seen
    assert _traces(ray_run["uri_on"], PROJECT_OFF, 0, timeout_s=0) == []
