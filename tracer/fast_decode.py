"""token2text without transformers' per-id Python: the Rust decoder of a fast tokenizer, called
directly where that gives exactly what ``tokenizer.decode`` gives.

``PreTrainedTokenizerBase.decode`` first walks the ids in Python (``to_py_obj`` checks each
one), about half of the background's decoding time for a traced rollout. For a plain Hugging
Face fast tokenizer with ``clean_up_tokenization_spaces`` off, ``decode(ids,
skip_special_tokens=False)`` is ``backend_tokenizer.decode(ids, skip_special_tokens=False)``
and nothing more. Anything else (a subclass that overrides decoding, clean-up on, a tokenizer
of another library) keeps ``tokenizer.decode``. The shortcut is also checked once per
tokenizer on a real sequence against ``tokenizer.decode``; one difference and it is not used.
Nothing here imports transformers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_BASE = "transformers.tokenization_utils_base"
_FAST = "transformers.tokenization_utils_tokenizers"
_MAX_TOKENIZERS = 16
# id(tokenizer) -> (tokenizer kept alive so its id is not reused, the decoder or None)
_cache: dict[int, tuple[Any, Callable[[list[int]], str] | None]] = {}
_lock = threading.Lock()


def _candidate(tokenizer: Any) -> Callable[[list[int]], str] | None:
    cls = type(tokenizer)
    decode, inner = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    if getattr(decode, "__module__", None) != _BASE or getattr(inner, "__module__", None) != _FAST:
        return None  # decoding overridden somewhere, or not a transformers fast tokenizer
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend_decode = getattr(backend, "decode", None)
    if backend_decode is None:
        return None

    def fast(ids: list[int]) -> str:
        return str(backend_decode(ids, skip_special_tokens=False))

    return fast


def fast_decoder(tokenizer: Any, sample: list[int]) -> Callable[[list[int]], str] | None:
    """The shortcut for ``tokenizer`` (checked on ``sample`` the first time), or None."""
    entry = _cache.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    fast = _candidate(tokenizer)
    if fast is not None:
        try:
            if fast(sample) != tokenizer.decode(sample, skip_special_tokens=False):
                fast = None
        except Exception:
            fast = None
    with _lock:
        if len(_cache) >= _MAX_TOKENIZERS:
            _cache.clear()
        _cache[id(tokenizer)] = (tokenizer, fast)
    return fast
