"""A deterministic engine that replays given response strings, tokenized with a real tokenizer."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollout.engines.base import GenerateOutput, SamplingParams, stop_ids_for

Script = Mapping[str, Iterable[str]] | Iterable[str] | Callable[[str, int], str]


class ScriptedEngine:
    """Replays scripted responses; the real tokenizer turns them into token ids.

    ``script`` is one of:

    * a mapping from a substring of the decoded prompt to the responses for that
      conversation, returned in order (turn 1, turn 2, ...; the turn is counted from the number
      of assistant turns already in the prompt);
    * an iterable of responses, consumed as one shared queue (in call order);
    * a callable ``(prompt_text, call_index) -> response``.

    Responses get the tokenizer's end-of-turn token appended (finish reason ``"stop"``) unless
    they would exceed ``max_tokens`` (truncated, ``"length"``).
    """

    def __init__(
        self, tokenizer: Any, script: Script, default: str = "I cannot answer that.", delay_s=0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.default = default
        self.delay_s = float(delay_s)
        self.calls = 0
        self._map: dict[str, list[str]] | None = None
        self._queue: deque[str] | None = None
        self._fn: Callable[[str, int], str] | None = None
        if callable(script):
            self._fn = script
        elif isinstance(script, Mapping):
            self._map = {k: list(v) for k, v in script.items()}
        else:
            self._queue = deque(script)

    def _pick(self, prompt_text: str) -> str:
        index = self.calls
        self.calls += 1
        if self._fn is not None:
            return self._fn(prompt_text, index)
        if self._queue is not None:
            return self._queue.popleft() if self._queue else self.default
        assert self._map is not None
        turn = prompt_text.count("<|im_start|>assistant") - 1  # the generation prompt counts one
        for key, responses in self._map.items():
            if key in prompt_text:
                return responses[turn] if 0 <= turn < len(responses) else self.default
        return self.default

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        """Return the next scripted response as token ids (deterministic)."""
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = self._pick(prompt_text)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        stops = stop_ids_for(self.tokenizer, params)
        for i, tok in enumerate(ids):
            if tok in stops:  # a stop token inside the script ends the response there
                ids = ids[: i + 1]
                return self._out(ids, "stop", params)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(eos, int) or eos == getattr(self.tokenizer, "unk_token_id", None):
            eos = self.tokenizer.eos_token_id
        ids.append(eos)
        if len(ids) > params.max_tokens:
            return self._out(ids[: params.max_tokens], "length", params)
        return self._out(ids, "stop", params)

    @staticmethod
    def _out(ids: list[int], reason: str, params: SamplingParams) -> GenerateOutput:
        logprobs = [0.0] * len(ids) if params.logprobs else None
        return GenerateOutput(token_ids=ids, finish_reason=reason, logprobs=logprobs)

    async def close(self) -> None:
        """Nothing to release."""
