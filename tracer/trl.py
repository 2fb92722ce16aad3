"""TRL's ``GRPOTrainer``, traced with one line: every completion a trajectory.

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), tools=[...])
    tracer.trl.trace(trainer, backend="mlflow", project_name="gsm8k")
    trainer.train()

Imported only by TRL users (``import tracer`` never imports this module, TRL or torch). It
wraps three methods of the one trainer object it is given and adds a callback, nothing else:

- ``_generate_and_score_completions``: the one place where TRL holds a generation batch's
  completions (structured messages with tool calls and tool results), token ids, the reward of
  every reward function and the advantages together. After TRL's own code returns, the batch is
  copied into one trajectory per completion and handed to the tracer's buffer (no I/O, no
  decoding here; the pipeline does that in the background). It is a private method of TRL, so
  :func:`trace` checks the trainer's shape first and names the tested versions when it differs.
- ``_calculate_rewards``: where the batch's prompts and completions meet the reward of every
  reward function, of every process (kept for the batch: TRL's own completion log holds only
  the last training batch's rows, fewer than an evaluation batch may have).
- ``log`` (public): the step's live analysis (``tracer.step_metrics``: ``patterns/*``,
  ``timing/*``, ``tracer/stuck_trajectories`` and the tracer's counters) joins the step's
  metrics, so it reaches the trackers TRL already reports to (``report_to``), in the same run;
  with several processes, merged (:mod:`tracer.trl_ranks`).
- a ``TrainerCallback``: tells the keep rules when a training step or an evaluation is over.

``docs/trl.md`` gives the mapping from TRL's fields to the trajectory's.
"""

from __future__ import annotations

import logging
from time import time_ns
from typing import Any

import tracer
from tracer.errors import InternalErrors
from tracer.trl_ranks import step_metrics
from tracer.trl_spans import num, reward_span, rows, size, spans, token_turns, tokenizer_name

log = logging.getLogger(__name__)

# the lowest and the highest major.minor CI tests (.ci/constraints-lowest.txt; the main venv's
# newest in pyproject's range): a version between them is a tested range, not a warning
TESTED_TRL = ("1.8", "1.16")
_NEEDS = ("_generate_and_score_completions", "_calculate_rewards", "reward_func_names",
          "reward_weights",
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
    if missing:
        version = _trl_version()
        raise TrlVersionError(
            f"tracer.trl: this trainer ({type(trainer).__name__}, TRL {version}) lacks "
            f"{', '.join(missing)}; tracer.trl is tested with GRPOTrainer of TRL "
            f"{TESTED_TRL[0]} to {TESTED_TRL[1]}.x"
        )
    version = _trl_version()
    if version is not None and not _in_tested_range(version):
        log.warning("tracer.trl: TRL %s is untested (tested: %s to %s.x); tracing goes on",
                    version, *TESTED_TRL)  # fmt: skip


def _minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def _in_tested_range(version: str) -> bool:
    low, high = (_minor(v) for v in TESTED_TRL)
    return low <= _minor(version) <= high


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
        self._calculate = trainer._calculate_rewards
        self._scored: tuple[Any, Any, Any] | None = None  # the batch TRL scored last
        self._log = trainer.log
        self._rows_seen: dict[tuple[int, bool], int] = {}
        self._callback: Any = None

    def install(self) -> None:
        self.trainer._generate_and_score_completions = self._generate_and_score
        self.trainer._calculate_rewards = self._calculate_and_keep
        self.trainer.log = self._log_with_metrics
        self._callback = _step_end_callback()
        self.trainer.add_callback(self._callback)

    def remove(self) -> None:
        for name in ("_generate_and_score_completions", "_calculate_rewards", "log"):
            self.trainer.__dict__.pop(name, None)
        if self._callback is not None:
            self.trainer.remove_callback(self._callback)
            self._callback = None

    def _calculate_and_keep(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_calculate_rewards(inputs, prompts, completions, completion_ids)``: the
        process's prompts (with an environment's ``reset()`` text) and completions, and the
        rewards of every process's rows, kept for the batch's trajectories."""
        rewards = self._calculate(*args, **kwargs)
        named = dict(zip(("inputs", "prompts", "completions"), args, strict=False)) | kwargs
        self._scored = (named.get("prompts"), named.get("completions"), rewards)
        return rewards

    def _generate_and_score(self, inputs: Any) -> Any:
        t0 = time_ns()
        self._scored = None
        output = self._generate(inputs)
        try:  # a tracing error never reaches the trainer (but does in the project's tests)
            self._record(inputs, output, t0)
        except Exception as exc:
            self.errors.report("tracer.trl: tracing a generation batch", exc)
        return output

    def _log_with_metrics(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # only the logs every process writes at once (a training step's, an evaluation's): the
        # numbers of several processes are merged by a collective they all must enter
        if self.trainer.model.training and "loss" in logs:
            self._add_step_metrics(logs, validate=False)
        elif "eval_loss" in logs:
            self._add_step_metrics(logs, validate=True)
        self._log(logs, start_time)

    def _add_step_metrics(self, logs: dict[str, float], validate: bool) -> None:
        """The live analysis of the step TRL logs now (its completions' step), every
        process's merged; the main process logs them (evaluation's as ``eval_*``)."""
        tr = self.trainer
        try:
            found, errors = step_metrics(tr.accelerator, tr.state.global_step, validate,
                                         self.traced)  # fmt: skip
        except Exception as exc:
            self.errors.report("tracer.trl: the step's live metrics", exc)
            return
        for error in errors:
            self.errors.report("tracer.trl: the step's live metrics", RuntimeError(error))
        prefix = "eval_" if validate else ""
        logs.update({prefix + key: value for key, value in (found or {}).items()})

    def _record(self, inputs: list[dict[str, Any]], output: dict[str, Any], t0: int) -> None:
        tr = self.trainer
        local = len(inputs)
        if not tracer.get_tracer().active or local == 0:
            return
        validate = not tr.model.training
        world, rank = tr.accelerator.num_processes, tr.accelerator.process_index
        prompts, completions, rewards = self._scored or (None, None, None)
        if prompts is None or completions is None or rewards is None:
            raise ValueError("tracer.trl: TRL scored no completions in this batch")
        # TRL gathers every process's rewards, in process order: this process's rows follow
        # those of the processes before it; the advantages are this process's already
        mine = rewards.tolist()[rank * local : (rank + 1) * local]
        advantages = output["advantages"].tolist()
        names = list(tr.reward_func_names)
        parts = {name: [row[i] for row in mine] for i, name in enumerate(names)}
        weights = [float(w) for w in tr.reward_weights.tolist()]
        ids = token_turns(output)
        prompt_ids = rows(output["prompt_ids"], output["prompt_mask"]) if ids else None
        logprobs = output.get("sampling_per_token_logps")
        lps = rows(logprobs, output["completion_mask"]) if logprobs is not None else None
        eos = set(getattr(tr, "eos_token_ids", None) or [])
        groups = tr.num_generations if not validate else getattr(tr, "num_generations_eval", None)
        groups = groups or tr.num_generations
        step = tr.state.global_step + (0 if validate else 1)  # the step TRL logs them under
        before = self._batch_offset(step, validate, local * world)
        tokenizer = getattr(tr, "processing_class", None)
        tokenizer_id = tokenizer_name(tokenizer)
        t1 = time_ns()
        for j in range(local):
            # the row in the step's gathered batches: a GRPO group is consecutive rows, which
            # may lie on several processes (every process computes the same index for a row)
            index = before + rank * local + j
            scores = {name: num(parts[name][j]) for name in names}
            present = [(w, s) for w, s in zip(weights, scores.values(), strict=True)
                       if s is not None]  # fmt: skip
            total = sum(w * s for w, s in present) if present else None
            with tracer.trace_attr(step=step, sample_index=index // groups,
                                   rollout_n=index % groups, validate=validate, name="completion",
                                   policy_version=tr.state.global_step, reward=total,
                                   advantage=num(advantages[j]),
                                   framework="trl") as traj:  # fmt: skip
                if traj is None:
                    continue
                traj.start_ns = t0
                made = spans(traj.root_id, prompts[j], completions[j], ids[j] if ids else None,
                             prompt_ids[j] if prompt_ids else None, lps[j] if lps else None,
                             eos, t0, t1)  # fmt: skip
                made.append(reward_span(traj.root_id, completions[j], scores, total,
                                        t1 + len(made)))  # fmt: skip
                for span in made:
                    if span.kind == "generate":
                        span.tokenizer = tokenizer
                        if tokenizer_id:  # an export decodes the tokens table by it
                            span.set_attr("tokenizer", tokenizer_id)
                traj.spans.extend(made)
                traj.nbytes += sum(size(s.inputs) + size(s.outputs) for s in made)
        self.traced += local

    def _batch_offset(self, step: int, validate: bool, rows: int) -> int:
        """Rows of (step, validate) traced before this batch (all processes): an evaluation
        runs several batches under one step, and so does training when a step generates more
        than once; every process sees the same batches in the same order."""
        key = (step, validate)
        before = self._rows_seen.get(key, 0)
        self._rows_seen = {k: v for k, v in self._rows_seen.items() if k[0] >= step - 1}
        self._rows_seen[key] = before + rows
        return before


def _step_end_callback() -> Any:
    """A ``TrainerCallback`` that tells the keep rules a step is over: a training step after
    its optimizer step, an evaluation when it ends (its batches all traced)."""
    from transformers import TrainerCallback

    class _EndStep(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tracer.end_step(state.global_step, False)

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tracer.end_step(state.global_step, True)

    return _EndStep()
