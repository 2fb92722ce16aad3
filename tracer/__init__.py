"""rollout-tracer: trace agentic RL rollouts (verl-style) at near-zero cost to the rollout.

    import tracer

    tracer.init({"backend": "mlflow", "project_name": "gsm8k", "token2text": True,
                 "max_samples_per_step_per_worker": 8})

    @tracer.trace_op(kind="generate")
    async def generate(self, prompt_ids, sampling_params): ...

    with tracer.trace_attr(step=step, sample_index=i, rollout_n=k):
        await agent_loop.run(...)

    tracer.flush()  # e.g. at the end of a training step

Importing this package imports none of mlflow, weave, torch or transformers.
"""

from tracer.config import ConfigError, TraceConfig
from tracer.core import (
    Tracer,
    TracerInitError,
    annotate,
    end_step,
    flush,
    get_tracer,
    init,
    metrics,
    new_run_salt,
    register_tokenizer,
    reset,
    shutdown,
)
from tracer.live import step_metrics
from tracer.ops import current_trajectory, set_span_attributes, trace_attr, trace_op
from tracer.record import SCHEMA_VERSION, SpanRecord, TrajectoryRecord
from tracer.verl_compat import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

__version__ = "0.1.0"

__all__ = [
    "SCHEMA_VERSION",
    "ConfigError",
    "RolloutTraceConfig",
    "SpanRecord",
    "TraceConfig",
    "Tracer",
    "TracerInitError",
    "TrajectoryRecord",
    "annotate",
    "current_trajectory",
    "end_step",
    "flush",
    "get_tracer",
    "init",
    "metrics",
    "new_run_salt",
    "register_tokenizer",
    "reset",
    "rollout_trace_attr",
    "rollout_trace_op",
    "set_span_attributes",
    "shutdown",
    "step_metrics",
    "trace_attr",
    "trace_op",
]
