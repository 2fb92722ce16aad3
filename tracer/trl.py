"""TRL's ``GRPOTrainer``, traced with one line: every completion a trajectory.

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), tools=[...])
    tracer.trl.trace(trainer, backend="mlflow", project_name="gsm8k")
    trainer.train()

Imported only by TRL users (``import tracer`` never imports this module, TRL or torch). It
wraps two methods of the one trainer object it is given, nothing else:

- ``_generate_and_score_completions``: the one place where TRL holds a generation batch's
  completions (structured messages with tool calls and tool results), token ids, the reward of
  every reward function and the advantages together. After TRL's own code returns, the batch is
  copied into one trajectory per completion and handed to the tracer's buffer (no I/O, no
  decoding here; the pipeline does that in the background). It is a private method of TRL, so
  :func:`trace` checks the trainer's shape first and names the tested versions when it differs.
- ``log`` (public): the step's live analysis (``tracer.step_metrics``: ``patterns/*``,
  ``timing/*``, ``tracer/stuck_trajectories`` and the tracer's counters) joins the step's
  metrics, so it reaches the trackers TRL already reports to (``report_to``), in the same run.

``docs/trl.md`` gives the mapping from TRL's fields to the trajectory's.
"""

from __future__ import annotations

import ast
import logging
import math
from time import time_ns
from typing import Any

import tracer
from tracer.errors import InternalErrors
from tracer.trajectory import Span

log = logging.getLogger(__name__)

TESTED_TRL = ("1.16",)  # major.minor versions the integration is tested against
_NEEDS = ("_generate_and_score_completions", "_logs", "reward_func_names", "reward_weights",
          "num_generations", "state", "accelerator", "log", "add_callback")  # fmt: skip


class TrlVersionError(RuntimeError):
    """The trainer lacks what the integration reads (another TRL version)."""


def trace(trainer: Any, config: Any = None, **options: Any) -> TrlTrace:
    """Trace every completion ``trainer`` (a TRL ``GRPOTrainer``) generates, from now on.

    With ``config`` or ``options``, calls ``tracer.init(config, **options)`` first (the same
    settings as everywhere: backend, sampling, redaction, spool); without, it uses the tracer
    already initialised. Returns the handle; ``handle.remove()`` stops tracing the trainer.

    Example::

        tracer.trl.trace(trainer, backend="mlflow", project_name="gsm8k")
    """
    _check(trainer)
    if config is not None or options:
        tracer.init(config, **options)
    handle = TrlTrace(trainer)
    handle.install()
    return handle


def _check(trainer: Any) -> None:
    missing = [name for name in _NEEDS if not hasattr(trainer, name)]
    logs = getattr(trainer, "_logs", None)
    if isinstance(logs, dict):
        missing += [f"_logs[{k!r}]" for k in ("prompt", "completion", "rewards", "advantages")
                    if k not in logs]  # fmt: skip
    if missing:
        version = _trl_version()
        raise TrlVersionError(
            f"tracer.trl: this trainer ({type(trainer).__name__}, TRL {version}) lacks "
            f"{', '.join(missing)}; tracer.trl is tested with GRPOTrainer of TRL "
            f"{', '.join(v + '.x' for v in TESTED_TRL)}"
        )
    version = _trl_version()
    if version is not None and ".".join(version.split(".")[:2]) not in TESTED_TRL:
        log.warning("tracer.trl: TRL %s is untested (tested: %s); tracing goes on",
                    version, ", ".join(TESTED_TRL))  # fmt: skip


def _trl_version() -> str | None:
    import sys

    module = sys.modules.get("trl")
    return getattr(module, "__version__", None)


class TrlTrace:
    """The installed wrappers of one trainer; :meth:`remove` takes them off."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.traced = 0  # completions handed to the tracer (sampled or not)
        config = tracer.get_tracer().config
        self.errors = InternalErrors(bool(getattr(config, "raise_internal_errors", False)))
        self._generate = trainer._generate_and_score_completions
        self._log = trainer.log

    def install(self) -> None:
        self.trainer._generate_and_score_completions = self._generate_and_score
        self.trainer.log = self._log_with_metrics

    def remove(self) -> None:
        for name in ("_generate_and_score_completions", "log"):
            self.trainer.__dict__.pop(name, None)

    def _generate_and_score(self, inputs: Any) -> Any:
        t0 = time_ns()
        output = self._generate(inputs)
        try:  # a tracing error never reaches the trainer (but does in the project's tests)
            self._record(inputs, output, t0)
        except Exception as exc:
            self.errors.report("tracer.trl: tracing a generation batch", exc)
        return output

    def _log_with_metrics(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.trainer.model.training and not any(k.startswith("eval_") for k in logs):
            try:  # the live analysis of the step TRL logs now (its completions' step)
                logs.update(tracer.step_metrics(self.trainer.state.global_step, timeout_s=5.0))
            except Exception as exc:
                self.errors.report("tracer.trl: the step's live metrics", exc)
            logs["tracer/trl_completions"] = float(self.traced)
        self._log(logs, start_time)

    def _record(self, inputs: list[dict[str, Any]], output: dict[str, Any], t0: int) -> None:
        tr = self.trainer
        local = len(inputs)
        if not tracer.get_tracer().active or local == 0:
            return
        validate = not tr.model.training
        world, rank = tr.accelerator.num_processes, tr.accelerator.process_index
        logs = tr._logs
        first = len(logs["prompt"]) - local * world + local * rank  # this process's rows
        if first < 0:
            raise ValueError("tracer.trl: TRL's completion log holds fewer rows than the batch")
        rows = range(first, first + local)
        prompts = [logs["prompt"][i] for i in rows]
        completions = [logs["completion"][i] for i in rows]
        advantages = [logs["advantages"][i] for i in rows]
        names = list(tr.reward_func_names)
        parts = {name: [logs["rewards"][name][i] for i in rows] for name in names}
        weights = [float(w) for w in tr.reward_weights.tolist()]
        ids = _token_turns(output)
        prompt_ids = _rows(output["prompt_ids"], output["prompt_mask"]) if ids else None
        logprobs = output.get("sampling_per_token_logps")
        lps = _rows(logprobs, output["completion_mask"]) if logprobs is not None else None
        eos = set(getattr(tr, "eos_token_ids", None) or [])
        groups = tr.num_generations if not validate else getattr(tr, "num_generations_eval", None)
        groups = groups or tr.num_generations
        step = tr.state.global_step + (0 if validate else 1)  # the step TRL logs them under
        t1 = time_ns()
        for j in range(local):
            index = rank * local + j  # row in the gathered batch: groups are consecutive rows
            scores = {name: _num(parts[name][j]) for name in names}
            present = [(w, s) for w, s in zip(weights, scores.values(), strict=True)
                       if s is not None]  # fmt: skip
            total = sum(w * s for w, s in present) if present else None
            with tracer.trace_attr(step=step, sample_index=index // groups,
                                   rollout_n=index % groups, validate=validate, name="completion",
                                   policy_version=tr.state.global_step, reward=total,
                                   advantage=_num(advantages[j]),
                                   framework="trl") as traj:  # fmt: skip
                if traj is None:
                    continue
                traj.start_ns = t0
                spans = _spans(traj.root_id, prompts[j], completions[j], ids[j] if ids else None,
                               prompt_ids[j] if prompt_ids else None, lps[j] if lps else None,
                               eos, t0, t1)  # fmt: skip
                spans.append(_reward_span(traj.root_id, completions[j], scores, total,
                                          t1 + len(spans)))  # fmt: skip
                tokenizer = getattr(tr, "processing_class", None)
                for span in spans:
                    if span.kind == "generate":
                        span.tokenizer = tokenizer
                traj.spans.extend(spans)
                traj.nbytes += sum(_size(s.inputs) + _size(s.outputs) for s in spans)
        self.traced += local
        # the batch is the whole step (per process): the keep rules may decide its groups now
        tracer.end_step(step, validate)


def _num(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _rows(tensor: Any, mask: Any) -> list[list[Any]]:
    """Each row of a padded (batch x length) tensor, cut to its mask."""
    values, keep = tensor.tolist(), mask.tolist()
    return [
        [v for v, m in zip(row, k, strict=False) if m] for row, k in zip(values, keep, strict=True)
    ]


def _token_turns(output: dict[str, Any]) -> list[list[tuple[list[int], list[int]]]] | None:
    """Per completion: its model turns' token ids, each with the tool-result ids that follow
    it (TRL's ``tool_mask`` 0), as (model_ids, tool_ids) pairs."""
    ids = output.get("completion_ids")
    if ids is None:
        return None
    mask = output["completion_mask"]
    rows = _rows(ids, mask)
    tool = output.get("tool_mask")
    tools = _rows(tool, mask) if tool is not None else [[1] * len(r) for r in rows]
    out = []
    for row, marks in zip(rows, tools, strict=True):
        turns: list[tuple[list[int], list[int]]] = []
        for token, mark in zip(row, marks, strict=False):
            if not turns or (mark and turns[-1][1]):  # a model token after tool tokens
                turns.append(([], []))
            turns[-1][1 if not mark else 0].append(token)
        out.append(turns)
    return out


def _spans(root: int, prompt: Any, completion: Any, turns: list[tuple[list[int], list[int]]] | None,
           prompt_ids: list[int] | None, logprobs: list[float] | None, eos: set[int], t0: int,
           t1: int) -> list[Span]:  # fmt: skip
    """One generate span per assistant message (its prompt ids: the prompt and every token
    before the turn, tool results included) and one tool span per tool call. TRL does not
    time single turns: each span carries the generation batch's window (start ``t0`` plus its
    order in nanoseconds, end ``t1``) and ``timing="trl_batch"``."""
    messages = completion if isinstance(completion, list) else [
        {"role": "assistant", "content": completion}]  # fmt: skip
    history = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if turns is not None and len(turns) != len(assistant):
        turns = None  # TRL rolled a turn back (too long): keep the text, not misplaced ids
    spans: list[Span] = []
    offset = 0
    context = list(prompt_ids or [])
    for k, i in enumerate(assistant):
        msg = messages[i]
        calls = msg.get("tool_calls") or []
        out: dict[str, Any] = {"content": _text(msg.get("content")), "tool_calls": calls or None}
        inputs: dict[str, Any] = {"messages": history + messages[:i]}
        if turns is not None:
            model_ids = turns[k][0]
            if prompt_ids is not None:
                inputs["prompt_ids"] = list(context)
                context += model_ids + turns[k][1]
            out["response_ids"] = list(model_ids)
            if logprobs is not None:
                out["logprobs"] = logprobs[offset : offset + len(model_ids)]
            offset += len(model_ids) + len(turns[k][1])
            last = model_ids[-1] if model_ids else None
            out["finish_reason"] = ("tool_calls" if calls else
                                    "stop" if last in eos else "length")  # fmt: skip
        gen = Span("generate", "generate", root, inputs, t0 + len(spans) + 1)
        gen.outputs, gen.end_ns = out, t1
        gen.set_attr("timing", "trl_batch")
        spans.append(gen)
        results = [m for m in messages[i + 1 :]]
        results = results[: next((n for n, m in enumerate(results) if m.get("role") != "tool"),
                                 len(results))]  # fmt: skip
        for c, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, dict) else {}
            name = str(function.get("name", "unknown"))
            result = results[c].get("content") if c < len(results) else None
            tool = Span(name, "tool", root, {"name": name, "arguments": function.get("arguments")},
                        t0 + len(spans) + 1)  # fmt: skip
            tool.outputs, tool.end_ns = _tool_result(result), t1
            tool.set_attr("tool_name", name)
            tool.set_attr("timing", "trl_batch")
            spans.append(tool)
    return spans


def _tool_result(content: Any) -> Any:
    """A tool message's content; TRL writes a failed call as ``str({"error": message})``:
    that becomes ``{"content": ..., "error": message}``, which every reader counts as failed."""
    if content is None:
        return {"content": None, "error": "no result (TRL dropped it: too long)"}
    if isinstance(content, str) and content.startswith("{'error': "):
        try:
            parsed = ast.literal_eval(content)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, dict) and set(parsed) == {"error"}:
            return {"content": content, "error": str(parsed["error"])}
    return content if isinstance(content, str) else {"content": content}


def _reward_span(root: int, completion: Any, scores: dict[str, float | None],
                 total: float | None, start: int) -> Span:  # fmt: skip
    """The reward span: each reward function's value under its name (the reward parts, as a
    verl reward function's extra keys), then ``score``, the weighted sum TRL trains on."""
    text = completion
    if isinstance(completion, list):
        text = next((_text(m.get("content")) for m in reversed(completion)
                     if m.get("role") == "assistant"), None)  # fmt: skip
    span = Span("reward", "reward", root, {"solution_str": text}, start)
    span.outputs = {**scores, "score": total}
    span.end_ns = start
    return span


def _text(content: Any) -> Any:
    if isinstance(content, list):  # content blocks: their text parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content


def _size(value: Any) -> int:
    return len(repr(value)) if value is not None else 0
