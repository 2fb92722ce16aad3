"""The tokenizer a reader needs for token text: a local Hugging Face folder, or a builtin model
already converted into the model cache.

A reader only decodes ids it reads back, so it loads what is on this machine and builds nothing:
converting the builtin models (``smollm2-135m-instruct``, ``tiny-qwen3``, ``qwen-tokenizer``)
is the demo rollout's work (rollout/models.py, which keeps them in :func:`model_cache`).
``rollout-tracer export``, ``explore`` and ``report`` use this module, never rollout/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def model_cache() -> Path:
    """Where converted models live: ``$ROLLOUT_TRACER_CACHE/models``, else
    ``~/.cache/rollout-tracer/models``. rollout/models.py builds into it."""
    base = os.environ.get("ROLLOUT_TRACER_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "rollout-tracer"
    return root / "models"


def cached_model(name: str) -> Path | None:
    """``model_cache()/name`` when a finished conversion is there (its ``.complete`` marker)."""
    folder = model_cache() / name
    return folder if name and "/" not in name and (folder / ".complete").exists() else None


def tokenizer_folder(name: str) -> Path:
    """A local folder, or a model in the cache by its name; ``ValueError`` saying why not."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    cached = cached_model(name)
    if cached is not None:
        return cached
    raise ValueError(f"tokenizer {name!r} is neither a local folder nor a model in "
                     f"{model_cache()} (a builtin model is converted there by its first "
                     "`rollout-tracer run`)")  # fmt: skip


def load_tokenizer(name: str) -> Any:
    """The Hugging Face tokenizer of :func:`tokenizer_folder`'s folder (transformers needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_folder(name)))


def _hub_id(name: str) -> bool:
    """``org/model``: a Hugging Face model id, not a path on this machine."""
    return "/" in name and not name.startswith(("/", ".", "~")) and not Path(name).exists()


def _hub_tokenizer(name: str) -> tuple[Any, str]:
    """A Hugging Face model id's tokenizer from the local Hugging Face cache only (an export
    never downloads): (tokenizer, "") or (None, why not)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True), ""
    except ImportError as exc:
        return None, f"{exc.name} is not installed: pip install 'rollout-tracer[rollout]'"
    except Exception:  # not in the cache (OSError), or a broken cached copy
        return None, ("neither a local folder, a model in the cache, nor a Hugging Face model id "
                      "in this machine's Hugging Face cache (the export never downloads)")


class TraceTokenizers:
    """The tokenizer a trace names (token2text records its ``name_or_path``), for an export's
    tokens table: loaded once per name; a local folder, a model in the cache by name, a
    cache folder recorded on another machine (found here by its last part), or a Hugging
    Face model id already in this machine's Hugging Face cache. ``missing`` says,
    per name, why it could not be loaded; ``unnamed`` counts trajectories that name none."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}
        self.missing: dict[str, str] = {}
        self.unnamed = 0

    def __call__(self, name: str | None) -> Any:
        if name is None:
            self.unnamed += 1
            return None
        if name not in self.loaded:
            self.loaded[name] = self._load(name)
        return self.loaded[name]

    def _load(self, name: str) -> Any:
        base = Path(name.rstrip("/")).name
        candidates = [name] + ([base] if base != name and cached_model(base) else [])
        why = "neither a local folder nor a model in the cache on this machine"
        local = False
        for candidate in candidates:
            try:
                tokenizer_folder(candidate)
            except ValueError:
                continue  # not on this machine: the next candidate
            local = True
            try:
                return load_tokenizer(candidate)
            except ImportError as exc:
                why = f"{exc.name} is not installed: pip install 'rollout-tracer[rollout]'"
            except Exception as exc:  # a folder without tokenizer files, a broken one
                why = f"{type(exc).__name__}: {exc}"
        if not local and _hub_id(name):
            found, hub_why = _hub_tokenizer(name)
            if found is not None:
                return found
            why = hub_why
        self.missing[name] = why
        return None

    def note(self, token_rows: int) -> str | None:
        """What to tell the user when the tokens table was written without text, or None."""
        if not token_rows or not (self.missing or (self.unnamed and not self.loaded)):
            return None
        why = "; ".join(f"{n}: {w}" for n, w in self.missing.items()) if self.missing else \
            "the traces name no tokenizer (token2text records the one it used)"  # fmt: skip
        return (f"the tokens table has token ids without their text ({why}); add --tokenizer "
                "NAME (a builtin model name or a local Hugging Face folder)")
