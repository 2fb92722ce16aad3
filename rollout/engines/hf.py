"""A transformers engine on CPU: concurrent requests are batched (left padding) and run with
``model.generate`` in a worker thread, so the event loop never blocks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import GenerateOutput, SamplingParams, stop_ids_for


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerateOutput]
    enqueued: float = field(default_factory=time.perf_counter)


class HFEngine:
    """Batched ``transformers`` generation.

    Calls to :meth:`generate` that arrive within ``batch_window_s`` of each other (up to
    ``max_batch_size``) are collected into one left-padded batch. Requests in a batch that
    differ in temperature, top-p, stop tokens or tool choice run as separate sub-batches; a
    sub-batch is seeded with its first request's seed (reproducible for the same batch
    composition). ``tool_choice`` ``required``/``none`` is structured decoding with xgrammar
    (:mod:`rollout.engines.structured`), a new logits processor per ``generate``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_batch_size: int = 16,
        batch_window_s: float = 0.02,
        num_threads: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        # torch threads for generation; default leaves one core to the event loop, tools and
        # the tracer's exporter (2 torch threads on 2 busy cores ran 5x slower than 1)
        self.num_threads = num_threads or max(1, (os.cpu_count() or 2) - 1)
        self.batches_run = 0
        self.batch_sizes: list[int] = []
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else tokenizer.eos_token_id
        self._grammars: Any = None  # rollout.engines.structured.ToolGrammars, built on first use

    @classmethod
    def from_config(cls, config: dict[str, Any], **kwargs: Any) -> HFEngine:
        """Build from the verl-shaped config (model path, ``rollout.max_batch_size``,
        ``rollout.num_threads``)."""
        aro = config["actor_rollout_ref"]
        rollout = aro["rollout"]
        kwargs.setdefault("max_batch_size", int(rollout.get("max_batch_size") or 16))
        kwargs.setdefault("num_threads", rollout.get("num_threads"))
        return cls.from_pretrained(aro["model"]["path"], **kwargs)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFEngine:
        """Load a builtin model name (e.g. ``smollm2-135m-instruct``) or a local HF folder."""
        from rollout.models import load_model

        model, tok = load_model(path)
        return cls(model, tok, **kwargs)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        """Queue one request; resolved when its batch has run."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if params.tool_choice != "auto" and params.tools and self._grammars is None:
            from rollout.engines.structured import ToolGrammars

            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
            self._grammars = ToolGrammars(self.tokenizer, vocab)  # fails here if not installed
        loop = asyncio.get_running_loop()
        if self._queue is None or self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._batch_loop(), name="hf-engine-batcher")
        req = _Request(list(prompt_ids), params, loop.create_future())
        await self._queue.put(req)
        return await req.future

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_window_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            groups: dict[tuple[Any, ...], list[_Request]] = {}
            for r in batch:
                p = r.params
                choice = p.tool_choice if p.tools else "auto"
                tools = json.dumps(p.tools, sort_keys=True) if choice != "auto" else ""
                key = (p.temperature, p.top_p, tuple(sorted(p.stop_token_ids)), choice, tools)
                groups.setdefault(key, []).append(r)
            for reqs in groups.values():
                live = [r for r in reqs if not r.future.done()]  # skip cancelled callers
                if not live:
                    continue
                try:
                    outs = await loop.run_in_executor(self._pool, self._run_batch, live)
                except Exception as exc:  # the engine failed: every caller sees the error
                    for r in live:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                for r, out in zip(live, outs, strict=True):
                    if not r.future.done():
                        r.future.set_result(out)

    def _run_batch(self, reqs: list[_Request]) -> list[GenerateOutput]:
        """Blocking: one padded ``model.generate`` call (runs in the worker thread)."""
        import torch

        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        params = reqs[0].params
        stops = stop_ids_for(self.tokenizer, params)
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        max_new = max(r.params.max_tokens for r in reqs)
        sample = params.temperature > 0
        kwargs: dict[str, Any] = {
            "do_sample": sample,
            "max_new_tokens": max_new,
            "eos_token_id": sorted(stops),
            "pad_token_id": self.pad_token_id,
            "return_dict_in_generate": True,
            "output_logits": any(r.params.logprobs for r in reqs),
        }
        if params.tools and params.tool_choice != "auto":
            grammar = self._grammars.logits_processor(params.tools, params.tool_choice)
            kwargs["logits_processor"] = [grammar]
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        rng: Any = torch.random.fork_rng() if params.seed is not None else contextlib.nullcontext()
        with torch.inference_mode(), rng:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out.sequences[:, width:]
        logprobs = None
        if out.logits is not None:
            logits = torch.stack(out.logits, dim=1).float()  # [batch, new, vocab]
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1))[..., 0]
        self.batches_run += 1
        self.batch_sizes.append(len(reqs))
        return [self._finish(r, new[i].tolist(), logprobs, i, stops) for i, r in enumerate(reqs)]

    @staticmethod
    def _finish(
        r: _Request, tokens: list[int], logprobs: Any, row: int, stops: set[int]
    ) -> GenerateOutput:
        reason = "length"
        cut = min(len(tokens), r.params.max_tokens)
        for j, tok in enumerate(tokens[:cut]):
            if tok in stops:
                cut, reason = j + 1, "stop"
                break
        lps = None
        if r.params.logprobs and logprobs is not None:
            lps = [float(x) for x in logprobs[row, :cut].tolist()]
        return GenerateOutput(token_ids=tokens[:cut], finish_reason=reason, logprobs=lps)

    async def close(self) -> None:
        """Stop the batcher task and the worker thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
            self._task = None
        self._pool.shutdown(wait=False, cancel_futures=True)
