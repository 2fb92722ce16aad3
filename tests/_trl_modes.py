"""TRL's GRPOTrainer the ways its users run it besides plain training, traced, in one process
(tests/test_trl_modes.py runs it as a subprocess, beside the example script under two
processes):

- ``env``: an ``environment_factory`` whose tool is a method of the environment and whose
  ``get_reward`` is a reward source, reward functions named ``score`` and ``fmt`` with weights
  (``fmt`` returns None for odd rows), an evaluation (``eval_strategy="steps"``, three prompts
  in two batches, the first larger than a training batch), a Qwen3 chat template (thinking
  parsed apart);
- ``rollout``: a ``rollout_func`` whose completions hold environment tokens (``env_mask`` 0).

The tiny random Qwen3 model (tiny-qwen3) never calls a tool or thinks by itself: the FIRST turn
of every even row is forced (TEST-ONLY, ``_force_first_turn``) to a thinking block and a tool
call; TRL parses it, runs the environment's tool and lets the model go on, as for a real model.

    python -m tests._trl_modes OUT_DIR      # writes OUT_DIR/{env,rollout}.jsonl, result.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FORCED = ('<think>\nThree more makes five.\n</think>\n\n<tool_call>\n{"name": "add", '
          '"arguments": {"amount": 3}}\n</tool_call><|im_end|>')  # fmt: skip
THOUGHT = "Three more makes five."
ROLLOUT_FIRST, ROLLOUT_ENV = "Answer: 5", "\n[environment] correct\n"
ROLLOUT_LAST = " Done.<|im_end|>"
QUESTIONS = ["Make the counter five.", "Reach five.", "Five, please.", "Get to five.", "Five?"]


class Counter:
    """A tiny environment: a counter that the model changes with its tool."""

    def __init__(self) -> None:
        self.value = 0

    def reset(self, start: int = 0, **_: Any) -> str:
        self.value = int(start)
        return f" The counter is at {self.value}."

    def add(self, amount: int) -> str:
        """Add an amount to the counter.

        Args:
            amount: The amount to add.
        """
        self.value += int(amount)
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value == 5)


def score(completions: list[Any], **_: Any) -> list[float | None]:
    return [0.5 + 0.1 * (i % 2) for i in range(len(completions))]  # by rollout_n (groups of 2)


def fmt(completions: list[Any], **_: Any) -> list[float | None]:
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def _dataset(questions: list[str]) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "start": 2}
                              for q in questions])  # fmt: skip


def _tokenizer() -> Any:
    import trl
    from transformers import AutoTokenizer

    from rollout.models import TINY_QWEN3, resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(TINY_QWEN3)))
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return tok


def _config(out: Path, name: str, **extra: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / name), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=48, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, learning_rate=1e-6, **extra,
    )  # fmt: skip


def _force_first_turn(trainer: Any, tokenizer: Any) -> None:
    """TEST-ONLY: the first turn of every even row becomes FORCED (thinking + a tool call)."""
    original_generate, original_turn = trainer._generate, trainer._generate_single_turn
    batch: dict[str, Any] = {}

    def generate(prompts: list[Any]) -> Any:
        batch["first"] = True
        return original_generate(prompts)

    def single_turn(prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        ids, logprobs = original_turn(prompt_ids, *args, **kwargs)
        if batch.pop("first", False):
            for i in range(0, len(ids), 2):
                ids[i] = tokenizer.encode(FORCED, add_special_tokens=False)
        return ids, logprobs

    trainer._generate, trainer._generate_single_turn = generate, single_turn


def run_env(out: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    import tracer
    import tracer.trl
    from rollout.models import TINY_QWEN3, resolve_model_path

    tok = _tokenizer()
    config = _config(out, "env", reward_weights=[2.0, 1.0], eval_strategy="steps", eval_steps=1,
                     per_device_eval_batch_size=4, num_generations_eval=2)  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TINY_QWEN3))),
        reward_funcs=[score, fmt], args=config, train_dataset=_dataset(QUESTIONS[:2]),
        eval_dataset=_dataset(QUESTIONS[2:]), processing_class=tok, environment_factory=Counter,
    )  # fmt: skip
    _force_first_turn(trainer, tok)
    tracer.trl.trace(trainer, backend="jsonl", jsonl_path=str(out / "env.jsonl"),
                     project_name="trl-modes", experiment_name="env",
                     raise_internal_errors=True)  # fmt: skip
    trainer.train()
    assert tracer.flush(60)
    tracer.shutdown()
    return {"reward_func_names": list(trainer.reward_func_names),
            "log_history": trainer.state.log_history}  # fmt: skip


def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
    """A rollout_func: a scripted model turn, environment feedback, a second model turn."""
    tok = trainer.processing_class
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                                 "env_mask": [], "source": []}  # fmt: skip
    for i, prompt in enumerate(prompts):
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        first, env, last = (tok.encode(t, add_special_tokens=False)
                            for t in (ROLLOUT_FIRST, ROLLOUT_ENV, ROLLOUT_LAST))  # fmt: skip
        out["prompt_ids"].append(tok.encode(text, add_special_tokens=False))
        out["completion_ids"].append(first + env + last)
        out["env_mask"].append([1] * len(first) + [0] * len(env) + [1] * len(last))
        out["logprobs"].append([-0.25] * len(first + env + last))
        out["source"].append(f"scripted-{i}")
    return out


def run_rollout(out: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    import tracer
    import tracer.trl
    from rollout.models import TINY_QWEN3, resolve_model_path

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TINY_QWEN3))),
        reward_funcs=[score], args=_config(out, "rollout"), train_dataset=_dataset(QUESTIONS[:2]),
        processing_class=_tokenizer(), rollout_func=rollout,
    )  # fmt: skip
    tracer.trl.trace(trainer, backend="jsonl", jsonl_path=str(out / "rollout.jsonl"),
                     project_name="trl-modes", experiment_name="rollout",
                     raise_internal_errors=True)  # fmt: skip
    trainer.train()
    assert tracer.flush(60)
    tracer.shutdown()
    return {"log_history": trainer.state.log_history}


def main(out: Path) -> None:
    import torch

    torch.set_num_threads(1)  # this test process's own choice: two cores shared by the suite
    result = {"env": run_env(out), "rollout": run_rollout(out)}
    (out / "result.json").write_text(json.dumps(result, default=str), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
