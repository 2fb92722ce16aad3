"""``tracer.annotate`` on the OTLP, Weave and Trackio backends, each read back through its
real counterpart: a lean ``mlflow server`` receiving OTLP/HTTP (MLflow's own client and the
export's reader), weave's real client over the in-process trace server (its feedback API),
and trackio's own local store."""

from __future__ import annotations

import time
from typing import Any

import pytest

import tracer
from tests._servers import MlflowServer
from tracer.annotations import token_values
from tracer.tokens import VALUE_ATTR_PREFIX, decode_floats

SALT = "5a" * 16
TRAIN = [-0.5, -0.25, -2.0]
REF = [-0.75, -0.25, -1.5]
ROLLOUT = [-0.5, -0.125, -1.0]


@tracer.trace_op(kind="generate")
def generate(prompt_ids: list[int]) -> dict[str, Any]:
    return {"response_ids": [7, 8, 9], "finish_reason": "stop", "logprobs": ROLLOUT}


def _rollout(samples: int) -> None:
    for i in range(samples):
        with tracer.trace_attr(step=1, sample_index=i, rollout_n=0):
            generate([1, 2, 3])


def _annotate(sample: int = 0) -> None:
    assert tracer.annotate(step=1, sample_index=sample, rollout_n=0,
                           values={"train_logprob": TRAIN, "ref_logprob": REF, "advantage": 0.5})


def test_otlp_annotation_lands_in_the_trace(mlflow_server: MlflowServer) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from mlflow.tracking import MlflowClient

    from tracer.readers.sources import iter_mlflow

    exp = "otlp-annotate"
    exp_id = mlflow_server.experiment_id(exp)
    tracer.init({"backend": "otlp", "project_name": exp, "run_salt": SALT,
                 "otlp_endpoint": f"{mlflow_server.url}/v1/traces",
                 "otlp_headers": {"x-mlflow-experiment-id": exp_id},
                 "raise_internal_errors": True})  # fmt: skip
    _rollout(2)
    assert tracer.flush(timeout_s=60)
    _annotate()
    _annotate()  # again: the same span id, so still one annotation
    assert tracer.flush(timeout_s=60)
    m = tracer.metrics()
    assert m["tracer/annotations/otlp/applied"] == 2 and "tracer/annotations/otlp/failed" not in m
    tracer.shutdown()

    client = MlflowClient(tracking_uri=mlflow_server.url)
    deadline = time.monotonic() + 30
    while True:
        [trace] = client.search_traces(locations=[exp_id], filter_string="tags.sample_index = '0'")
        names = [s.name for s in trace.data.spans]
        if "annotation" in names or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert names.count("annotation") == 1 and names.count("trajectory") == 1, names
    root = next(s for s in trace.data.spans if s.parent_id is None)
    [ann] = [s for s in trace.data.spans if s.name == "annotation"]
    assert ann.parent_id == root.span_id
    assert decode_floats(ann.attributes[VALUE_ATTR_PREFIX + "train_logprob"]) == TRAIN
    assert ann.attributes[VALUE_ATTR_PREFIX + "advantage"] == 0.5
    # the export's reader: the tokens table gets the engine's and the trainer's values
    records = {r.sample_index: r for page in iter_mlflow(mlflow_server.url, exp) for r in page}
    values = token_values(records["0"].spans if "0" in records else records[0].spans)
    assert values["rollout_logprob"] == ROLLOUT and values["train_logprob"] == TRAIN
    assert values["ref_logprob"] == REF
    other = records["1"] if "1" in records else records[1]
    assert "train_logprob" not in token_values(other.spans)


def test_weave_annotation_is_call_feedback(weave_server: Any) -> None:
    import uuid

    from weave.trace.context.weave_client_context import set_weave_client_global
    from weave.trace.weave_client import WeaveClient

    from tracer.backends.weave_backend import FEEDBACK_TYPE

    tracer.init({"backend": "weave", "project_name": "weave-annotate", "weave_entity": "team",
                 "run_salt": SALT, "raise_internal_errors": True,
                 "annotation_timeout_s": 2.0})  # fmt: skip
    _rollout(2)
    assert tracer.flush(timeout_s=30)
    _annotate()
    _annotate()  # again: the same feedback row
    assert tracer.flush(timeout_s=30)
    # sample 7 was never traced: its annotation waits for a trace that never comes, then is
    # lost (counted), and that flush says so
    assert tracer.annotate(step=1, sample_index=7, rollout_n=0, values={"advantage": 1.0})
    assert not tracer.flush(timeout_s=30)
    m = tracer.metrics()
    assert m["tracer/annotations/weave/applied"] == 2, m
    assert m["tracer/annotations/weave/annotation_lost"] == 1, m
    roots = {c["attributes"]["sample_index"]: c["id"] for c in weave_server.calls()
             if c["parent_id"] is None}  # fmt: skip
    tracer.shutdown()

    # read back with weave's own client: the root call's feedback
    reader = WeaveClient("team", "weave-annotate", weave_server, ensure_project_exists=False)
    set_weave_client_global(reader)
    try:
        [feedback] = list(reader.get_call(roots[0]).feedback)
        assert list(reader.get_call(roots[1]).feedback) == []
    finally:
        set_weave_client_global(None)
    assert feedback.feedback_type == FEEDBACK_TYPE
    values = feedback.payload["values"]
    assert decode_floats(values["train_logprob"]) == TRAIN
    assert decode_floats(values["ref_logprob"]) == REF and values["advantage"] == 0.5
    assert feedback.payload["summary"]["ref_kl_mean"] > 0
    uuid.UUID(feedback.id)


def test_trackio_annotation_is_a_trace_at_the_step(trackio_dir: Any) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    tracer.init({"backend": "trackio", "project_name": "trackio-annotate",
                 "experiment_name": "grpo", "run_salt": SALT,
                 "raise_internal_errors": True})  # fmt: skip
    _rollout(2)
    assert tracer.flush(timeout_s=30)
    _annotate()
    assert tracer.flush(timeout_s=30)
    assert tracer.metrics()["tracer/annotations/trackio/applied"] == 1
    tracer.shutdown()

    from trackio import Api

    assert len(list(Api().runs("trackio-annotate"))) == 1  # annotations: the traces' run
    traces = SQLiteStorage.get_traces("trackio-annotate", run="grpo", sort="request_time_asc")
    [ann] = [t for t in traces if t["key"] == "rollout_trace/annotation"]
    meta = ann["metadata"]
    assert ann["step"] == 1 and meta["kind"] == "annotation" and meta["sample_index"] == 0
    assert decode_floats(meta["values"]["train_logprob"]) == TRAIN
    assert meta["values"]["advantage"] == 0.5
    generates = [t for t in traces if t["key"] == "rollout_trace/generate"]
    assert len(generates) == 2
    assert meta["trace_id"] == next(g["metadata"]["trace_id"] for g in generates
                                    if g["metadata"]["sample_index"] == 0)  # fmt: skip
