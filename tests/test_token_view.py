"""Per-token values: the engine's log-probs on generate spans, values the trainer attaches
later from another process (tracer.annotate), the export's tokens table and its KL values."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracer
from tests.conftest import search_traces
from tracer.tokens import LOGPROBS_ATTR, decode_floats, encode_floats

pytest.importorskip("mlflow")
# one worker runs the module: the annotated store below is made once, not once per worker
pytestmark = [pytest.mark.xdist_group("token-view"), pytest.mark.slow(seconds=40)]

PROJECT = "token-view"
SALT = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
ROOT = Path(__file__).resolve().parents[1]


class Engine:
    """Returns float32 log-probs (as engines compute them) for a few response tokens."""

    tokenizer = None

    def __init__(self) -> None:
        self.returned: dict[tuple[int, int, int], list[list[float]]] = {}
        self.rng = np.random.default_rng(7)

    @tracer.trace_op(kind="generate")
    def generate(self, prompt_ids: list[int]) -> dict[str, Any]:
        n = 3 + len(prompt_ids) % 4
        lps = (-self.rng.exponential(0.8, n)).astype(np.float32)
        return {"response_ids": list(range(100, 100 + n)), "finish_reason": "stop",
                "logprobs": [float(x) for x in lps]}  # fmt: skip


def _config(tmp: Path, uri: str) -> dict[str, Any]:
    return {"backend": ["mlflow", "jsonl"], "tracking_uri": uri,
            "jsonl_path": str(tmp / "traces.jsonl"), "project_name": PROJECT,
            "experiment_name": "grpo", "raise_internal_errors": True,
            "run_salt": SALT}  # fmt: skip


def _rollout(tmp: Path, uri: str) -> dict[tuple[int, int, int], list[float]]:
    """Two steps x 3 samples x 2 rollouts, two generate calls each; returns the engine's
    log-probs per identity (model tokens in order)."""
    tracer.init(_config(tmp, uri))
    engine = Engine()
    out: dict[tuple[int, int, int], list[float]] = {}
    for step in (1, 2):
        for sample in range(3):
            for n in range(2):
                with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
                    first = engine.generate(list(range(5 + sample)))
                    second = engine.generate(list(range(6 + n)))
                out[(step, sample, n)] = first["logprobs"] + second["logprobs"]
    assert tracer.flush(timeout_s=60)
    return out


def test_engine_logprobs_read_back_equal(tmp_path: Path, mlflow_uri: str) -> None:
    returned = _rollout(tmp_path, mlflow_uri)
    traces = search_traces(mlflow_uri, PROJECT)
    assert len(traces) == 12
    for trace in traces:
        tags = trace.info.tags
        key = (int(tags["step"]), int(tags["sample_index"]), int(tags["rollout_n"]))
        gens = sorted((s for s in trace.data.spans if s.span_type == "CHAT_MODEL"),
                      key=lambda s: s.start_time_ns)  # fmt: skip
        got = [v for s in gens for v in decode_floats(s.attributes[LOGPROBS_ATTR]) or []]
        assert got == returned[key]  # float32 in, float32 out: exact
        # the span view shows a marker, not a thousand numbers
        assert "log-probs" in gens[0].outputs["logprobs"]
        assert float(tags["logprob_min"]) == pytest.approx(min(returned[key]), abs=1e-6)


def _annotate_in_subprocess(tmp: Path, uri: str, values: dict[str, Any]) -> None:
    script = textwrap.dedent("""
        import json, sys, tracer
        tracer.init(json.loads(sys.argv[1]))
        for key, vals in json.loads(sys.argv[2]).items():
            step, sample, n = map(int, key.split(","))
            tracer.annotate(step=step, sample_index=sample, rollout_n=n, values=vals)
        # a sample never traced: this process cannot tell "not sampled" from "not stored
        # yet", so it waits annotation_timeout_s, then counts it lost, and flush says so once
        tracer.annotate(step=1, sample_index=99, rollout_n=0, values={"train_logprob": [0.0]})
        assert not tracer.flush(60)
        m = tracer.metrics()
        assert m["tracer/annotations/mlflow/annotation_lost"] == 1, m
        assert m["tracer/annotations/mlflow/applied"] == len(json.loads(sys.argv[2])), m
        assert m.get("tracer/annotations/mlflow/skipped", 0) == 0, m
        assert tracer.flush(60)
        print(json.dumps(m))
    """)
    config = _config(tmp, uri)
    config["raise_internal_errors"] = True
    config["annotation_timeout_s"] = 2
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp),
           "MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "true"}  # fmt: skip
    argv = [sys.executable, "-c", script, json.dumps(config), json.dumps(values)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _trainer_values(returned: dict[tuple[int, int, int], list[float]]) -> dict[str, Any]:
    """What a trainer recomputes: log-probs a little off the engine's, a reference, entropy;
    verl's whole-response layout with a tool token (mask 0) after the first turn."""
    rng = np.random.default_rng(1)
    values = {}
    for (step, sample, n), lps in returned.items():
        train = (np.array(lps) + rng.normal(0, 0.05, len(lps))).round(6)
        ref = (train + rng.normal(0, 0.2, len(lps))).round(6)
        values[f"{step},{sample},{n}"] = {
            "train_logprob": [*train[:2], 0.0, *train[2:]],
            "ref_logprob": [*ref[:2], 0.0, *ref[2:]],
            "response_mask": [1, 1, 0] + [1] * (len(lps) - 2),
            "advantage": float(n) - 0.5,
        }
    return values


def _k3(logr: np.ndarray) -> np.ndarray:
    return np.expm1(logr) - logr


@pytest.fixture(scope="module")
def annotated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The rollout traced and annotated once for the module's readers (the idempotence test
    annotates it again: the others must read the same either way)."""
    tmp = tmp_path_factory.mktemp("token-view")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # the spool's default folder
        tracer.reset()
        returned = _rollout(tmp, uri)
        values = _trainer_values(returned)
        tracer.shutdown()
        tracer.reset()
    _annotate_in_subprocess(tmp, uri, values)
    return {"tmp": tmp, "uri": uri, "returned": returned, "values": values}


def test_annotations_from_another_process_land_on_the_right_trajectories(
    annotated: dict[str, Any],
) -> None:
    returned, values, mlflow_uri = annotated["returned"], annotated["values"], annotated["uri"]
    traces = search_traces(mlflow_uri, PROJECT)
    assert len(traces) == 12
    for trace in traces:
        tags = trace.info.tags
        key = f"{tags['step']},{tags['sample_index']},{tags['rollout_n']}"
        want = values[key]
        mask = np.array(want["response_mask"], bool)
        train = np.float32(np.array(want["train_logprob"])[mask]).astype(float)
        ref = np.float32(np.array(want["ref_logprob"])[mask]).astype(float)
        rollout = np.array(returned[tuple(map(int, key.split(",")))])
        (ann,) = [s for s in trace.data.spans if s.name == "annotation"]
        got = decode_floats(ann.attributes["rollout_tracer.values.train_logprob"])
        assert got == list(train)
        mismatch = _k3(train - rollout)
        assert float(tags["mismatch_kl_max"]) == pytest.approx(mismatch.max(), abs=2e-6)
        assert float(tags["mismatch_kl_mean"]) == pytest.approx(mismatch.mean(), abs=2e-6)
        assert float(tags["ref_kl_mean"]) == pytest.approx(_k3(ref - train).mean(), abs=2e-6)
        assert float(tags["advantage"]) == want["advantage"]
    # filterable: MLflow's own search finds a trajectory by an annotated tag
    hits = search_traces(mlflow_uri, PROJECT, "tags.advantage = '0.5'")
    assert len(hits) == 6


def test_annotating_twice_is_idempotent(annotated: dict[str, Any]) -> None:
    mlflow_uri = annotated["uri"]
    _annotate_in_subprocess(annotated["tmp"], mlflow_uri, annotated["values"])
    for trace in search_traces(mlflow_uri, PROJECT):
        assert [s.name for s in trace.data.spans].count("annotation") == 1


def test_encoding_round_trips_float32() -> None:
    values = [*np.float32(np.linspace(-30, 0, 1000)).astype(float).tolist(), float("nan")]
    decoded = decode_floats(encode_floats(values))
    assert decoded is not None and decoded[:-1] == values[:-1] and np.isnan(decoded[-1])
    assert len(encode_floats([0.0] * 1000)) < 5400


@pytest.mark.parametrize("source", ["mlflow", "jsonl"])
def test_tokens_table_matches_counts_and_numpy_kl(
    annotated: dict[str, Any], source: str
) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from tracer.readers import export

    tmp, returned, values = annotated["tmp"], annotated["returned"], annotated["values"]
    mlflow_uri = annotated["uri"]
    out = tmp / f"export-{source}"
    kwargs: dict[str, Any] = (
        {"experiment": PROJECT, "tracking_uri": mlflow_uri} if source == "mlflow"
        else {"path": str(tmp / "traces.jsonl")}
    )
    summary = export(source, str(out), **kwargs)
    tokens = pq.read_table(out / "tokens.parquet").to_pylist()
    trajectories = pq.read_table(out / "trajectories.parquet").to_pylist()
    turns = pq.read_table(out / "turns.parquet").to_pylist()
    assert summary.rows["tokens"] == len(tokens) == sum(t["response_tokens"] for t in turns)
    for traj in trajectories:
        key = (traj["step"], traj["sample_index"], traj["rollout_n"])
        mine = sorted((r for r in tokens if r["trace_id"] == traj["trace_id"]),
                      key=lambda r: r["position"])  # fmt: skip
        assert len(mine) == traj["response_tokens"] == len(returned[key])
        want = values[",".join(map(str, key))]
        mask = np.array(want["response_mask"], bool)
        train = np.float32(np.array(want["train_logprob"])[mask]).astype(float)
        ref = np.float32(np.array(want["ref_logprob"])[mask]).astype(float)
        rollout = np.array(returned[key])
        assert [r["rollout_logprob"] for r in mine] == list(rollout)
        assert [r["train_logprob"] for r in mine] == list(train)
        np.testing.assert_allclose([r["mismatch_kl"] for r in mine], _k3(train - rollout),
                                   atol=1e-12)  # fmt: skip
        np.testing.assert_allclose([r["mismatch_kl_k1"] for r in mine], rollout - train,
                                   atol=1e-12)  # fmt: skip
        np.testing.assert_allclose([r["ref_kl"] for r in mine], _k3(ref - train), atol=1e-12)
        assert all(r["loss_mask"] == 1 for r in mine)
        assert traj["mismatch_kl_max"] == pytest.approx(_k3(train - rollout).max())
        assert traj["logprob_min"] == pytest.approx(rollout.min())
