"""Under ``ROLLOUT_TRACER_VERL=1``, verl 0.9.1's own ``Tracking`` (console, MLflow, W&B offline)
logs the rollout workers' live numbers under each step verl logs, from two Ray worker
processes; late numbers are counted, a worker or the gatherer gone costs numbers, never the
training. Runs in the venv made by ``scripts/setup_verl_cpu.sh``::

    .venv-verl/bin/python -m pytest -q tests/test_verl_metrics.py -m verl_installed -n 0

The driver is a process of its own (tests/_verl_metrics_driver.py) with the variable set, as
in a verl job; this pytest process reads what the trackers stored: MLflow through
``MlflowClient``, W&B through its own record format, the console from the driver's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup_verl_cpu.sh only")
pytest.importorskip("ray")
mlflow = pytest.importorskip("mlflow")

pytestmark = [pytest.mark.verl_installed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
PROJECT, PER_STEP = "verl-live-metrics", 4
STEPS = range(1, 9)
LIVE = ("patterns/", "timing/", "tracer/live_step_trajectories")  # equal to the workers' own


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "WANDB_", "ROLLOUT_TRACER_", "MLFLOW_"))}  # fmt: skip
    return {**env, "ROLLOUT_TRACER_VERL": "1", "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
            "MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "true",
            "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(tmp / "wandb-config"), "NETRC": str(tmp / "no-netrc"),
            **extra}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("verl-metrics")
    code = "import sys; from tests._verl_metrics_driver import main; main(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp)], env=_env(tmp), cwd=tmp,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT "):])
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    (run_info,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    keys = run_info.data.metrics.keys()
    mlflow_steps: dict[int, dict[str, float]] = {}
    for key in keys:
        for m in client.get_metric_history(run_info.info.run_id, key):
            mlflow_steps.setdefault(m.step, {})[key] = m.value
    return {**result, "mlflow": mlflow_steps, "stdout": proc.stdout, "stderr": proc.stderr,
            "tmp": tmp}  # fmt: skip


def test_each_step_carries_the_workers_numbers_under_verls_step(run: dict[str, Any]) -> None:
    assert run["tracking"] == "verl.utils.tracking"  # verl's class, extended
    logged = run["mlflow"]
    assert sorted(logged) == list(STEPS)
    for step in STEPS:
        assert logged[step]["critic/score/mean"] == pytest.approx(0.1 * step)  # verl's own
        assert {"tracer/live_step_trajectories", "tracer/live_workers",
                "tracer/live_late_trajectories"} <= logged[step].keys()  # fmt: skip
    # steps whose numbers were in when verl logged them: those of both workers' partials,
    # merged (the workers' own, asked afterwards), under the same step as verl's metrics
    for step in (1, 2, 3, 5):
        expected = {k: v for k, v in run["expected"][str(step)].items() if k.startswith(LIVE)}
        assert {"patterns/unearned_reward_share", "timing/generate_share"} <= expected.keys()
        got = {k: v for k, v in logged[step].items() if k.startswith(LIVE)}
        assert got == pytest.approx(expected), step
        assert logged[step]["tracer/live_workers"] == 2
        assert logged[step]["tracer/live_step_trajectories"] == 2 * PER_STEP
        if step < 5:  # a rollout of step 5 hangs (below): it may count by step 5's log
            assert logged[step]["tracer/stuck_trajectories"] == 0


def test_late_numbers_are_counted_and_a_lost_worker_or_gatherer_costs_only_numbers(
    run: dict[str, Any],
) -> None:
    logged = run["mlflow"]
    late = {s: logged[s]["tracer/live_late_trajectories"] for s in STEPS}
    assert late[1] == late[2] == late[3] == late[4] == 0
    # step 4 was logged at once, before the workers' numbers were in: those in its numbers
    # plus those counted late afterwards are all of its trajectories
    assert logged[4]["tracer/live_step_trajectories"] + late[5] == 2 * PER_STEP
    # one worker killed after step 5: step 6 has the one left
    assert logged[6]["tracer/live_workers"] == 1
    assert logged[6]["tracer/live_step_trajectories"] == PER_STEP
    assert late[6] == late[5]
    # the gatherer killed before step 7: verl logged step 7 (its own metric is there), the
    # driver started the gatherer again, the worker sent again, step 8 has its numbers; step
    # 7's arrived late and are counted (a resent step 5 or 6 is not counted twice)
    assert logged[7]["tracer/live_step_trajectories"] + late[8] - late[7] == PER_STEP
    assert logged[8]["tracer/live_step_trajectories"] == PER_STEP
    # a rollout of step 5 whose tool call hangs (unsampled or not, the watchdog sees it): in
    # verl's tracker by step 8
    assert logged[8]["tracer/stuck_trajectories"] == 1
    err = run["stderr"]
    assert "the trainer logged step 4 before all its trajectories reached the driver" in err
    assert "the trainer logged step 7 before all its trajectories reached the driver" in err
    assert "cannot reach the driver (ActorDiedError" in err


def test_console_and_wandb_show_the_same_numbers(run: dict[str, Any]) -> None:
    from tests.test_trackers import _wandb_history

    console = {}
    for line in run["stdout"].splitlines():  # verl's LocalLogger: "step:3 - key:value - ..."
        if line.startswith("step:"):
            first, *items = line.split(" - ")
            console[int(first[5:])] = {k: float(v) for k, v in (i.rsplit(":", 1) for i in items)}
    (run_dir,) = (run["tmp"] / "wandb").glob("offline-run-*")
    wandb = _wandb_history(run_dir)
    for step in STEPS:
        for key in ("patterns/unearned_reward_share", "timing/generate_share",
                    "tracer/live_step_trajectories", "tracer/live_late_trajectories"):  # fmt: skip
            if key in run["mlflow"][step]:
                assert console[step][key] == pytest.approx(run["mlflow"][step][key])
                assert wandb[step][key] == pytest.approx(run["mlflow"][step][key])


def _python(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=_env(tmp, **env), cwd=tmp,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_without_ray_or_our_side_verl_logs_as_it_would(tmp_path: Path) -> None:
    code = ("from verl.utils.tracking import Tracking\n"
            "t = Tracking('p', 'e', default_backend='console')\n"
            "t.log(data={'critic/score/mean': 0.5}, step=1)\n"
            "print(type(t).__module__, len(type(t).__mro__))\n")  # 3: ours, verl's, object
    # no Ray in the driver: verl's metrics, nothing added
    plain = _python(code, tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[-2:] == ["step:1 - critic/score/mean:0.5",
                                              "verl.utils.tracking 3"]  # fmt: skip
    # rollout-tracer's part cannot load: verl's own Tracking, one warning
    cut = _python("import sys; sys.modules['tracer.verl_metrics'] = None\n" + code, tmp_path)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.splitlines()[-2:] == ["step:1 - critic/score/mean:0.5",
                                            "verl.utils.tracking 2"]  # fmt: skip
    assert cut.stderr.count("the live numbers cannot be added to verl's Tracking") == 1
