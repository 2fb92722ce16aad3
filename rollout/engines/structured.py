"""``tool_choice`` by structured decoding (xgrammar), as vLLM implements ``tool_choice="required"``.

``required`` constrains a turn to exactly one Hermes/Qwen tool call
(``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, then end of turn) whose
arguments match the tool's JSON schema; which tool and which argument values stay the model's
own choice. ``none`` forbids the ``<tool_call>`` tag. ``auto`` is unconstrained.

xgrammar is installed with ``pip install --no-deps xgrammar==0.2.9`` (its ``triton`` dependency
is ~1 GB and used on GPUs only); its other dependencies come with ``rollout-tracer[rollout]``.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from typing import Any

TOOL_CHOICES = ("auto", "required", "none")
XGRAMMAR_HINT = (
    "pip install --no-deps xgrammar==0.2.9 && pip install 'apache-tvm-ffi>=0.1.11' "
    "(or set actor_rollout_ref.rollout.multi_turn.tool_choice=auto)"
)


def check_tool_choice(value: Any) -> str:
    """``value`` if it is a valid tool choice, else ``ValueError`` with the valid ones."""
    if value not in TOOL_CHOICES:
        raise ValueError(f"unknown tool_choice {value!r}; valid: {', '.join(TOOL_CHOICES)}")
    return str(value)


def check_config(multi_turn: dict[str, Any] | None, engine: str) -> list[str]:
    """The ``multi_turn.tool_choice`` list of a config, validated: unknown values, or
    ``required``/``none`` on the hf engine without xgrammar installed, raise ``ValueError``
    (at start, with the install command, not at the first generate)."""
    raw = (multi_turn or {}).get("tool_choice") or "auto"
    choices = [check_tool_choice(c) for c in (raw if isinstance(raw, list) else [raw])]
    constrained = any(c != "auto" for c in choices) and (multi_turn or {}).get("enable", True)
    if constrained and engine == "hf" and importlib.util.find_spec("xgrammar") is None:
        raise ValueError(f"multi_turn.tool_choice={choices} needs xgrammar: {XGRAMMAR_HINT}")
    return choices


def xgrammar_module() -> Any:
    """The ``xgrammar`` module, or ``ModuleNotFoundError`` saying how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"tool_choice 'required'/'none' needs xgrammar ({exc}): {XGRAMMAR_HINT}"
        ) from exc
    return xgrammar


def structural_tag(xgr: Any, tools: list[dict[str, Any]], tool_choice: str) -> Any:
    """xgrammar's structural tag for one turn under ``tool_choice`` (both engines use it)."""
    return xgr.get_model_structural_tag(
        "qwen_3",  # the Hermes <tool_call> JSON format our template and parser use
        tools=tools,
        tool_choice=check_tool_choice(tool_choice),
        reasoning=False,  # no <think> block
        parallel_tool_calls=False,  # one call, then the end of the turn
        max_whitespace_cnt=1,  # no runs of indentation inside the JSON
    )


def structural_tag_json(tools: list[dict[str, Any]], tool_choice: str) -> str:
    """The same structural tag as JSON, as vLLM's structured outputs take it
    (``StructuredOutputsParams(structural_tag=...)``, compiled by vLLM's xgrammar backend)."""
    tag = structural_tag(xgrammar_module(), tools, tool_choice)
    return str(tag.model_dump_json())


class ToolGrammars:
    """Compiled tool-call grammars for one tokenizer, cached by (tools, tool_choice).

    :meth:`logits_processor` returns a new ``xgr.contrib.hf.LogitsProcessor`` per call: one
    processor serves exactly one ``generate``. Thread-safe (the HF engine compiles in its
    worker thread).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self.xgr = xgrammar_module()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _compile(self, tools: list[dict[str, Any]], tool_choice: str) -> Any:
        key = json.dumps([tool_choice, tools], sort_keys=True)
        with self._lock:
            if key not in self._cache:
                xgr = self.xgr
                if self._compiler is None:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size
                    )
                    self._compiler = xgr.GrammarCompiler(info)
                tag = structural_tag(xgr, tools, tool_choice)
                self._cache[key] = self._compiler.compile_structural_tag(tag)
            return self._cache[key]

    def logits_processor(self, tools: list[dict[str, Any]], tool_choice: str) -> Any:
        """A fresh HF logits processor constraining one ``generate`` to ``tool_choice``."""
        compiled = self._compile(tools, check_tool_choice(tool_choice))
        return self.xgr.contrib.hf.LogitsProcessor(compiled)
