"""token2text's shortcut to the Rust decoder (tracer/fast_decode.py) gives exactly what
``tokenizer.decode(ids, skip_special_tokens=False)`` gives, on a real tokenizer, and is not
used where it could differ."""

from __future__ import annotations

import copy
from typing import Any

from tracer.fast_decode import fast_decoder
from tracer.token_text import decode_ids


def test_same_text_as_decode_on_smollm2(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text = "<|im_start|>user\nWhat is 12 * 7? Ünïcödé ✓ 数学\n<|im_end|>\n<tool_call>{}</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    fast = fast_decoder(tok, ids)
    assert fast is not None  # the builtin model's tokenizer takes the shortcut
    for sample in (ids, ids[:1], ids[3:-2], [tok.eos_token_id], list(range(0, 4000, 37))):
        assert fast(sample) == tok.decode(sample, skip_special_tokens=False)
        assert decode_ids(tok, sample) == (tok.decode(sample, skip_special_tokens=False),
                                           len(sample))  # fmt: skip


def test_invalid_ids_still_become_markers(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text, n = decode_ids(tok, [1, -5, 2, len(tok) + 10, True])
    assert n == 5
    assert "<invalid token id -5>" in text and f"<invalid token id {len(tok) + 10}>" in text
    assert "<invalid token id True>" in text


def test_not_used_with_clean_up_or_an_overridden_decode(smollm2_tokenizer: Any) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.clean_up_tokenization_spaces = True  # transformers may change the text then
    assert fast_decoder(tok, [1, 2, 3]) is None

    class Custom(type(smollm2_tokenizer)):  # type: ignore[misc]
        def decode(self, ids: Any, **kwargs: Any) -> str:
            return "custom"

    custom = copy.deepcopy(smollm2_tokenizer)
    custom.__class__ = Custom
    assert fast_decoder(custom, [1, 2, 3]) is None
    assert decode_ids(custom, [1, 2, 3])[0] == "custom"


def test_a_shortcut_that_disagrees_is_dropped(smollm2_tokenizer: Any) -> None:
    class Lying:
        """Looks like a transformers fast tokenizer, but its backend decodes differently."""

        clean_up_tokenization_spaces = False

        class backend_tokenizer:  # the attribute name transformers uses
            @staticmethod
            def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
                return "backend"

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "front"

        def _decode(self, ids: list[int]) -> str:
            return "front"

    Lying.decode.__module__ = "transformers.tokenization_utils_base"
    Lying._decode.__module__ = "transformers.tokenization_utils_tokenizers"
    assert fast_decoder(Lying(), [1, 2]) is None
