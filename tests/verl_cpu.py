"""What tests/test_verl_installed.py needs around an installed, unmodified verl: the one part
that cannot run here (vLLM's GPU server) replaced by SmolLM2 on CPU, verl's own config, a
batch of math problems, and verl's own dump writer. Only imported in the verl venv.

The server is a Ray actor with the method verl's ``LLMServerClient.generate`` calls on a vLLM
server (``generate.remote(request_id=, prompt_ids=, sampling_params=, image_data=,
video_data=, ...) -> TokenOutput``); it is registered with verl's own load balancer, so every
other part (client, balancer, agent-loop worker, agent loops, tool parser, tools) is verl's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "smollm2-135m-instruct"
PROBLEMS = [
    ("What is 12 + 30? Use the calculator.", "42"),
    ("What is 7 * 6? Use the calculator.", "42"),
]
SYSTEM = "You are a math assistant. Call the calculator tool, then give the answer."


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 30"}},
            "required": ["expression"],
        },
    },
}


class CpuLLMServer:
    """SmolLM2-135M (rollout.engines.hf, the project's CPU engine) behind vLLM's server call.
    Keeps every ``sampling_params`` it was sent, to compare with what the traces say.

    SmolLM2-135M never writes a well-formed ``<tool_call>`` on its own, so a turn whose prompt
    offers tools and holds no tool response yet is decoded with ``tool_choice="required"``
    (structured decoding, as vLLM serves it): the tokens are still SmolLM2's choice."""

    def __init__(self, response_length: int, tools: list[dict[str, Any]] | None = None) -> None:
        from rollout.engines.hf import HFEngine

        self.engine = HFEngine.from_pretrained(MODEL, max_batch_size=8)
        self.response_length = response_length
        self.tools = tools
        self.received: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], image_data: Any = None,
                       video_data: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        from verl.workers.rollout.replica import TokenOutput

        from rollout.engines.base import SamplingParams

        self.received.append(dict(sampling_params))
        max_tokens = int(sampling_params.get("max_tokens") or self.response_length)
        top_k = int(sampling_params.get("top_k", -1))
        params = SamplingParams(
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            max_tokens=max_tokens, seed=0,
            logprobs=bool(sampling_params.get("logprobs")),
        )  # fmt: skip
        assert top_k in (-1, 0), "the CPU engine samples without top-k"
        params.stop_token_ids = list(sampling_params.get("stop_token_ids") or [])
        text = self.engine.tokenizer.decode(prompt_ids)
        if self.tools and "# Tools" in text and "<tool_response>" not in text:
            params.tool_choice, params.tools = "required", self.tools
        out = await self.engine.generate(list(prompt_ids), params, request_id)
        return TokenOutput(
            token_ids=out.token_ids, log_probs=out.logprobs,
            stop_reason="completed", num_preempted=0, extra_fields={"global_steps": 1},
        )  # fmt: skip

    def sampling_received(self) -> list[dict[str, Any]]:
        return self.received


def model_path() -> str:
    from rollout.models import resolve_model_path

    return str(resolve_model_path(MODEL))


def verl_config(trace: dict[str, Any], tool_config: str, response_length: int = 96) -> Any:
    """verl's whole trainer config (its generated defaults) with this run's settings, the way
    a ``main_ppo`` command line would set them."""
    import verl
    from omegaconf import OmegaConf

    from rollout.models import CHATML_TOOLS_TEMPLATE

    base = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(base)
    overrides = {
        "trainer.project_name": trace["project_name"],
        "trainer.experiment_name": trace["experiment_name"],
        "data.max_prompt_length": 512,
        "data.max_response_length": response_length,
        "actor_rollout_ref.rollout.prompt_length": 512,
        "actor_rollout_ref.rollout.response_length": response_length,
        "actor_rollout_ref.model.path": model_path(),
        "actor_rollout_ref.model.custom_chat_template": CHATML_TOOLS_TEMPLATE,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.rollout.top_p": 0.9,
        "actor_rollout_ref.rollout.calculate_log_probs": False,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": tool_config,
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.trace.backend": trace["backend"],
        "actor_rollout_ref.rollout.trace.token2text": trace["token2text"],
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker":
            trace["max_samples_per_step_per_worker"],
    }  # fmt: skip
    for key, value in overrides.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def write_tool_config(path: Path) -> str:
    """verl's own ``BaseTool`` declared as a calculator (its ``execute`` is verl's, traced)."""
    path.write_text(
        "tools:\n"
        "  - class_name: verl.tools.base_tool.BaseTool\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calculator\n"
        "        description: Evaluate an arithmetic expression.\n"
        "        parameters:\n"
        "          type: object\n"
        "          properties:\n"
        "            expression: {type: string, description: 'e.g. 12 + 30'}\n"
        "          required: [expression]\n"
    )
    return str(path)


def math_batch(agent_name: str, step: int, validate: bool, n: int = 1) -> Any:
    """The problems as verl's dataset hands them to the agent loop (``n`` rollouts each)."""
    from verl.protocol import DataProto

    rows = [(i, q, a) for i, (q, a) in enumerate(PROBLEMS) for _ in range(n)]
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
               for _, q, _ in rows]  # fmt: skip
    non_tensor = {
        "raw_prompt": np.array(prompts, dtype=object),
        "agent_name": np.array([agent_name] * len(rows), dtype=object),
        "index": np.array([i for i, _, _ in rows], dtype=object),
        "reward_model": np.array([{"ground_truth": a} for _, _, a in rows], dtype=object),
    }
    return DataProto.from_dict(non_tensors=non_tensor,
                               meta_info={"global_steps": step, "validate": validate})  # fmt: skip


def write_verl_dump(out_dir: str, step: int, tokenizer: Any) -> None:
    """verl's own ``RayPPOTrainer._log_rollout_data`` -> ``_dump_generations`` path (its
    constructor, which needs GPUs and workers, is skipped): decode, score, write
    ``out_dir/<step>.jsonl`` in its background thread, then drain it."""
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    answers = ["12 + 30 = 42. The answer is 42.", "7 * 6 = 48. The answer is 48."]
    prompts = [tokenizer.encode(q) for q, _ in PROBLEMS]
    responses = [tokenizer.encode(a) for a in answers]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id or 0
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts]),
            "responses": torch.tensor([r + [pad] * (width_r - len(r)) for r in responses]),
            "token_level_scores": torch.tensor([[0.0] * (width_r - 1) + [s] for s in (1.0, 0.0)]),
        },
        non_tensors={"reward_model": np.array([{"ground_truth": a} for _, a in PROBLEMS],
                                              dtype=object),
                     "request_id": np.array(["req-0", "req-1"], dtype=object)},
    )  # fmt: skip
    trainer = object.__new__(RayPPOTrainer)
    trainer.tokenizer = tokenizer
    trainer.global_steps = step
    trainer._init_dump_executor()
    trainer._log_rollout_data(batch, {"acc": np.array([1.0, 0.0])}, {}, out_dir)
    trainer._shutdown_dump_executor()


def verl_record_hashes() -> tuple[list[str], list[str]]:
    """Check every file of the installed verl against its wheel's RECORD (sha256): (files
    checked, files that differ)."""
    import base64
    import csv
    import hashlib
    from importlib.metadata import distribution

    dist = distribution("verl")
    checked: list[str] = []
    changed: list[str] = []
    with open(os.path.join(str(dist.locate_file("")), f"verl-{dist.version}.dist-info",
                           "RECORD"), newline="") as f:  # fmt: skip
        for path, digest, _size in csv.reader(f):
            if not digest or not path.startswith("verl/"):
                continue
            algo, _, expected = digest.partition("=")
            data = Path(str(dist.locate_file(path))).read_bytes()
            actual = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=")
            checked.append(path)
            if actual.decode() != expected:
                changed.append(path)
    return checked, changed
