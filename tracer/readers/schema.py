"""The four exported tables, declared once: column name, type, meaning.

``docs/export-schema.md`` documents these columns (a test checks it lists every one). Types are
Arrow type names; :func:`arrow_schema` builds the ``pyarrow`` schema (pyarrow is imported only
there, so importing this module stays cheap).
"""

from __future__ import annotations

from typing import Any

EXPORT_SCHEMA_VERSION = 1

# (column, arrow type, meaning)
Column = tuple[str, str, str]

TRAJECTORIES: list[Column] = [
    ("trace_id", "string", "32 hex chars; the MLflow trace is `tr-<trace_id>`"),
    ("experiment", "string", "MLflow experiment / Weave project (the tracer's project_name)"),
    ("experiment_name", "string", "the trainer's experiment_name tag"),
    ("name", "string", "root span name (`trace_attr(name=...)`)"),
    ("step", "int64", "training step; null if not set"),
    ("sample_index", "int64", "sample index in the step's batch; null if not an integer"),
    ("sample_key", "string", "sample_index as text (any type); with step, identifies a group"),
    ("rollout_n", "int64", "index of this rollout among the n of its sample (GRPO group)"),
    ("validate", "bool", "true for validation rollouts"),
    ("attempt", "int64", "0, 1, ...: a sample run again is a new trajectory (same identity)"),
    ("policy_version", "string", "policy/weights version tag, if recorded"),
    ("worker_id", "string", "rollout worker that produced the trajectory"),
    ("status", "string", "`OK` or `ERROR` (the root span's status)"),
    ("start_time", "timestamp[us, UTC]", "root span start"),
    ("latency_ms", "float64", "root span duration in milliseconds"),
    ("prompt", "string", "the last user message of the first generate call, else prompt_text"),
    ("prompt_text", "string", "decoded prompt token ids of the first generate call"),
    ("response_text", "string", "decoded response of the last generate call"),
    ("messages", "string", "JSON: the chat messages passed to the first generate call"),
    ("reward", "float64", "the trajectory's reward (MLflow `reward` assessment / record)"),
    ("num_turns", "int64", "number of generate spans"),
    ("num_tool_calls", "int64", "number of tool spans"),
    ("num_tool_errors", "int64", "tool spans that raised or returned an `error`"),
    ("finish_reason", "string", "finish reason of the last generate call"),
    ("prompt_tokens", "int64", "prompt tokens of the first generate call"),
    ("response_tokens", "int64", "generated tokens summed over all generate calls (so far, "
                                 "for a dropped one)"),
    ("error", "string", "the root span's error message, if it failed"),
    ("mismatch_kl_mean", "float64", "mean per-token KL(rollout ‖ trainer), k3 estimator"),
    ("mismatch_kl_max", "float64", "max per-token KL(rollout ‖ trainer), k3 estimator"),
    ("ref_kl_mean", "float64", "mean per-token KL(trainer ‖ reference), k3 estimator"),
    ("ref_kl_max", "float64", "max per-token KL(trainer ‖ reference), k3 estimator"),
    ("logprob_min", "float64", "lowest rollout (engine) log-prob of a model token"),
    ("logprob_mean", "float64", "mean rollout (engine) log-prob over model tokens"),
    ("entropy_mean", "float64", "mean entropy over model tokens, where annotated"),
    ("accuracy", "float64", "the reward span's `accuracy` (or `acc`) output, if it has one"),
    ("flags", "list<string>", "health flags (tracer/readers/health.py) on this trajectory"),
    ("kept_by", "string", "keep rules that stored it (`sampled` = head sampling), if any"),
    ("end_reason", "string", "why it ended: `completed`, or dropped: `cancelled` (asyncio "
                             "cancel, Ctrl-C, an engine abort), `timeout` (`TimeoutError` "
                             "reached the trajectory), `error` (it raised); a dropped one keeps "
                             "its spans so far and `response_tokens` counts its tokens so far"),
    ("signature", "string", "behaviour signature: 16 hex chars, equal for trajectories with the "
                            "same tool calls, finish reason and answer template "
                            "(tracer/readers/habits/signature.py)"),
    ("signature_text", "string", "the signature's parts: `tools: ... | finish: ... | answer: "
                                 "<template>` (numbers `<n>`, quoted values `<q>`)"),
    ("reward_parts", "map<string,float64>", "every numeric part of the reward: the reward span's "
                     "numeric outputs (verl's `score` and `reward_extra_info` keys such as `acc`, "
                     "`format`; one per TRL reward function), by name"),
    ("behaviour", "string", "the behaviour the patterns group by: `tools: ... | finish: ... | "
                  "reasoning: yes/no | answer: <form> | length: <class>` "
                  "(tracer/readers/habits/behaviour.py)"),
    # where the wall time went (readers/timing/breakdown.py): the five parts add up to latency_ms
    ("generate_ms", "float64", "time inside generate calls"),
    ("tool_ms", "float64", "time inside tool calls (a tool call wins over a span it overlaps)"),
    ("reward_ms", "float64", "time inside the reward"),
    ("other_ms", "float64", "time inside other spans (parse, interaction, ...)"),
    ("gap_ms", "float64", "time with no span open: queueing, scheduling, the loop's own code"),
    ("tool_ms_by_name", "string", "JSON: tool_ms per tool name"),
    ("slow_span_id", "string", "the span with the longest own work (its duration less what its "
                               "children cover: a leaf, or a reward's own work); null when the "
                               "slow part is `gap`"),
    ("slow_span_kind", "string", "that span's kind (`tool`, `generate`, ...), or `gap` when the "
                                 "time with no span open outweighs every span's own work"),
    ("slow_span_name", "string", "its tool name (tool calls) or span name (`gap`)"),
    ("slow_span_detail", "string", "its tool arguments (JSON) or `<n> tokens` (generate)"),
    ("slow_span_ms", "float64", "its own time in milliseconds (the gap's, for `gap`)"),
]

TURNS: list[Column] = [
    ("trace_id", "string", "the trajectory (join key)"),
    ("step", "int64", "training step (copied from the trajectory)"),
    ("turn_index", "int64", "0-based order of this generate call in the trajectory"),
    ("span_id", "string", "16 hex chars"),
    ("name", "string", "span name"),
    ("start_time", "timestamp[us, UTC]", "span start"),
    ("latency_ms", "float64", "span duration in milliseconds"),
    ("prompt_text", "string", "decoded prompt token ids (token2text)"),
    ("response_text", "string", "decoded response token ids (token2text)"),
    ("reasoning", "string", "the model's thinking, where it came apart from the answer "
                            "(`reasoning_content`: TRL with a Qwen3-style template)"),
    ("prompt_tokens", "int64", "number of prompt token ids"),
    ("response_tokens", "int64", "number of response token ids"),
    ("finish_reason", "string", "`stop`, `length`, ... as returned by the engine"),
    ("logprobs", "list<float64>", "per-token logprobs where the generate call returned them"),
    ("status", "string", "`OK` or `ERROR`"),
    ("error", "string", "error message if the call raised"),
]

TOOL_CALLS: list[Column] = [
    ("trace_id", "string", "the trajectory (join key)"),
    ("step", "int64", "training step (copied from the trajectory)"),
    ("call_index", "int64", "0-based order of this tool call in the trajectory"),
    ("turn_index", "int64", "the generate call it followed (-1 if before any)"),
    ("span_id", "string", "16 hex chars"),
    ("name", "string", "tool name"),
    ("arguments", "string", "JSON of the tool arguments"),
    ("result", "string", "the result: its `content` text if it has one, else JSON"),
    ("error", "string", "exception message, or the `error` field of the result; null if ok"),
    ("status", "string", "`OK` or `ERROR` (raised)"),
    ("start_time", "timestamp[us, UTC]", "span start"),
    ("latency_ms", "float64", "span duration in milliseconds"),
]

TOKENS: list[Column] = [
    ("trace_id", "string", "the trajectory (join key)"),
    ("step", "int64", "training step (copied from the trajectory)"),
    ("sample_index", "int64", "sample index (copied from the trajectory)"),
    ("rollout_n", "int64", "rollout index (copied from the trajectory)"),
    ("turn", "int64", "the generate call (turn_index) this token belongs to"),
    ("position", "int64", "0-based position in the trajectory's response (verl's layout)"),
    ("token_id", "int64", "the token id"),
    ("token", "string", "its text: the tokenizer given to the export, else the one the "
     "trace names (token2text records it); null when none can be loaded"),
    ("loss_mask", "int64", "1 for model tokens, 0 for tool and user tokens between turns"),
    ("rollout_logprob", "float64", "the engine's log-prob at sampling time (generate span)"),
    ("train_logprob", "float64", "the trainer's recomputed log-prob (tracer.annotate)"),
    ("ref_logprob", "float64", "the reference policy's log-prob (tracer.annotate)"),
    ("entropy", "float64", "the policy's entropy at this position (tracer.annotate)"),
    ("advantage", "float64", "per-token advantage (tracer.annotate)"),
    ("mismatch_kl", "float64", "k3 of KL(rollout ‖ trainer): exp(d) - 1 - d, "
                               "d = train_logprob - rollout_logprob"),
    ("mismatch_kl_k1", "float64", "k1 of the same: rollout_logprob - train_logprob"),
    ("ref_kl", "float64", "k3 of KL(trainer ‖ reference): exp(d) - 1 - d, "
                          "d = ref_logprob - train_logprob (verl's low_var_kl)"),
    ("ref_kl_k1", "float64", "k1 of the same: train_logprob - ref_logprob"),
]  # fmt: skip

# one row per (step, validate): readers/timing/breakdown.py's step_summaries; written beside the
# four tables as steps.parquet (not one of TABLES: it is derived from the trajectories table)
STEPS: list[Column] = [
    ("step", "int64", "training step"),
    ("validate", "bool", "true for validation rollouts"),
    ("trajectories", "int64", "trajectories of the step"),
    ("wall_p50_ms", "float64", "median trajectory wall time (latency_ms)"),
    ("wall_p90_ms", "float64", "90th percentile of the wall time"),
    ("wall_p99_ms", "float64", "99th percentile of the wall time"),
    ("wall_max_ms", "float64", "the slowest trajectory's wall time"),
    ("tail_ratio", "float64", "wall_p99_ms / wall_p50_ms"),
    ("tail_wait_ms", "float64", "last trajectory's end minus the 90th percentile of the ends: "
                                "how long the step waited for its tail"),
    ("generate_share", "float64", "sum of generate_ms over the summed wall time"),
    ("tool_share", "float64", "sum of tool_ms over the summed wall time"),
    ("reward_share", "float64", "sum of reward_ms over the summed wall time"),
    ("other_share", "float64", "sum of other_ms over the summed wall time"),
    ("gap_share", "float64", "sum of gap_ms over the summed wall time (the five add up to 1)"),
    ("tool_shares", "string", "JSON: each tool's share of the summed wall time"),
    ("stragglers", "int64", "trajectories over 3x the step's median and 25 ms over it"),
    ("top_straggler_trace_id", "string", "the slowest straggler"),
    ("top_straggler_cause", "string", "its slow span: `tool <name>`, `generate <name>`, or "
                                      "`gap` when time between spans outweighs it"),
    ("top_straggler_detail", "string", "the slow span's tool arguments or token count; for "
                                       "`gap`, that no span was open"),
    ("top_straggler_span_id", "string", "the slow span (its transcript opens there); null for "
                                        "`gap`"),
    ("top_straggler_ms", "float64", "the slowest straggler's wall time"),
    # what the step lost (readers/timing/drops.py)
    ("dropped", "int64", "trajectories that did not complete (end_reason not `completed`)"),
    ("dropped_cancelled", "int64", "of them, cancelled"),
    ("dropped_timeout", "int64", "of them, timed out"),
    ("dropped_error", "int64", "of them, raised"),
    ("groups", "int64", "samples (sample_key) of the step"),
    ("incomplete_groups", "int64", "samples with fewer completed rollouts than the step's group "
                                   "size (its highest rollout_n + 1)"),
    ("dropped_token_share", "float64", "the dropped trajectories' share of the step's generated "
                                       "tokens (response_tokens): tokens training never saw"),
    ("kept_tokens_mean", "float64", "mean response_tokens of the completed trajectories"),
    ("kept_tokens_p90", "float64", "90th percentile of the same"),
    ("dropped_tokens_mean", "float64", "mean response_tokens (so far) of the dropped ones"),
    ("dropped_tokens_p90", "float64", "90th percentile of the same"),
    ("length_bias", "bool", "the dropped ones wrote at least 1.25x the kept ones' mean: what "
                            "training sees is shorter than what the policy writes"),
]

TABLES: dict[str, list[Column]] = {
    "trajectories": TRAJECTORIES,
    "turns": TURNS,
    "tool_calls": TOOL_CALLS,
    "tokens": TOKENS,
}


def _arrow_type(name: str) -> Any:
    import pyarrow as pa

    simple = {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "timestamp[us, UTC]": pa.timestamp("us", tz="UTC"),
        "list<float64>": pa.list_(pa.float64()),
        "list<string>": pa.list_(pa.string()),
        "map<string,float64>": pa.map_(pa.string(), pa.float64()),
    }
    return simple[name]


def arrow_schema(table: str) -> Any:
    """The ``pyarrow.Schema`` of one of :data:`TABLES`, or of ``steps``."""
    import pyarrow as pa

    columns = STEPS if table == "steps" else TABLES[table]
    fields = [pa.field(name, _arrow_type(kind), metadata={"doc": doc}) for name, kind, doc in
              columns]  # fmt: skip
    return pa.schema(fields, metadata={"rollout_tracer.export_schema": str(EXPORT_SCHEMA_VERSION)})
