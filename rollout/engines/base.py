"""The one small async interface every rollout engine implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    """Per-request sampling parameters (a subset of vLLM's ``SamplingParams``)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's tool_choice: "auto" (free text), "required" (exactly one call to one of ``tools``,
    # by structured decoding), "none" (no tool call); engines without it ignore it
    tool_choice: str = "auto"
    tools: list[dict[str, Any]] | None = None  # OpenAI function-tool schemas


@dataclass
class GenerateOutput:
    """What one ``generate`` call returns: the new token ids only (never the prompt)."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] | None = None


@runtime_checkable
class Engine(Protocol):
    """An async token-in, token-out generation engine with a chat-template tokenizer."""

    tokenizer: Any  # HF tokenizer with a chat template

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        """Generate a continuation of ``prompt_ids``."""
        ...

    async def close(self) -> None:
        """Release the engine's resources."""
        ...


def stop_ids_for(tokenizer: Any, params: SamplingParams) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS (and ``<|im_end|>``) plus extras."""
    ids: set[int] = set(params.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(eos)
    try:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    except Exception:  # pragma: no cover - tokenizers without that token
        im_end = None
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(im_end, int) and im_end != unk:
        ids.add(im_end)
    return ids
