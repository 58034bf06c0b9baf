"""The one chunk planner of the attribution engines: every engine cuts its work into model calls here.

Each engine has a cost model (bytes one chunk needs, from the model's declared costs:
``activation_bytes_per_token``, ``kv_bytes_per_token``, ``vocab_size``) and a budget (``memory_budget_mb``, in
bytes via :func:`budget_bytes`); the greedy packing itself is C++ (``oar._C.plan_masked_chunks``,
``oar._C.plan_prefix_chunks``, ``src/core/masked_batch.cpp``, shared with the C++ engine). This module is Python
because the cost models read a Python :class:`~oar.attribution.model.ProbeModel`; it only turns them into the
planners' per-token / per-variant bytes, so every plan of the package comes from the same two C++ planners.

Cost models (bytes a chunk may use, compared with the budget):

- masked contexts (:func:`plan_masked`: OAR-P batched, OAR-G): variants x (padded width x activation bytes per
  token + probe bytes per variant); OAR-G (``backward``) adds its float32 noise and score accumulator per token and,
  with ``checkpoint``, takes the model's checkpointed cost;
- clean pass (:func:`plan_clean`): rows x (T x (activation [+ cache] bytes per token) + probe bytes), the cache
  counted when it is kept (prefix and windowed engines);
- prefix-cached OAR-P (:func:`plan_prefix`): variants x ((T - prefix) x activation + prefix x cache bytes + probe
  bytes), chunks also bounded by ``max_prefix_waste``;
- windowed OAR-P (:func:`plan_window`): variants x a fixed per-variant cost (re-run columns, copied cache, masks,
  probe bytes);
- policy entropies (:func:`plan_entropy`): rows x kept positions x V x 12 bytes (float32 logits, log-softmax and
  their product).

**What the budget covers.** ``memory_budget_mb`` bounds what one chunk's model call adds: its activations (at the
precision the model computes in, attention as the model's implementation runs it:
``ProbeModel.activation_bytes_per_token``), the key/value cache it copies or writes, its masks and its probe
logits. It does not cover what was resident before the engine ran (parameters, optimizer state, the batch) nor
what the engine keeps across chunks, :func:`resident_bytes`: the clean probe logits of the rows scored and, for the
prefix and windowed engines, their clean key/value cache (rows x T x ``kv_bytes_per_token``). So an engine call
peaks at most at ``budget + resident_bytes`` above what was resident (tests/python/attribution/test_memory_budget.py
measures it; docs/design.md, "Memory planner: what the budget covers"). Under FSDP / ZeRO-3 every model call all-gathers
the parameters of the layer it runs (FSDP2: one layer at a time; ZeRO-3: its prefetch buckets): pass as budget the
memory left after those gathered parameters, and prefer few large chunks (each chunk is a model call, hence a
gather of every layer): the planners pack as many items per chunk as the budget allows, and no engine caps a
chunk at one item unless asked (``max_variants_per_chunk``).

A chunk always takes its first item, even one over the budget (the caller then runs it alone, over the budget:
the planners log a warning on the ``"oar"`` logger naming the bytes it needs). The plans are lists of the C++
chunk objects: ``MaskedChunk`` (``begin``, ``end``, ``max_context_len``) or ``PrefixChunk`` (``begin``, ``end``,
``prefix_len``), item ranges [begin, end) in the order given.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from oar import _args
from oar._lib import load_extension
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeModel

_C = load_extension()
_log = logging.getLogger("oar")

#: Every engine's default ``memory_budget_mb``: the config's (``oar::core::OARConfig::memory_budget_mb``), so a call
#: without a budget plans as the pipeline does with the default config.
DEFAULT_MEMORY_BUDGET_MB: int = int(_C.OARConfig().memory_budget_mb)

#: Largest budget in MiB: its bytes fit the planners' int64 (products are taken in long double there).
_MAX_BUDGET_MB = (1 << 43) - 1


def budget_bytes(memory_budget_mb) -> int:
    """``memory_budget_mb`` (an int >= 1, integer 0-d tensors accepted) in bytes, capped so that the planners' int64
    never overflows.

    Raises:
        ValueError: ``memory_budget_mb`` not an int >= 1.
    """
    try:
        mb = _args.int_arg("memory_budget_mb", memory_budget_mb, tensors=True)
    except ValueError:
        mb = None
    if mb is None or mb < 1:
        raise ValueError(f"memory_budget_mb must be an int >= 1, got {memory_budget_mb!r}")
    return min(mb, _MAX_BUDGET_MB) << 20


def probe_bytes(model: ProbeModel, batch: ProbeBatch, *, backward: bool = False, per_chunk: bool = False) -> int:
    """Bytes of one variant's probe logits: ``keep`` positions x V, 8 bytes each (the logits and their float32 copy
    in the divergence). With ``backward`` (OAR-G's forward + backward w.r.t. the embeddings, issue 41) 16 bytes
    each: also the head's backward residue, the float32 gradient of the gathered probe logits and of the tail
    logits it is scattered into (4 + 4; the CUDA head product's compute-dtype copy of the latter,
    ``_MmFloat32Out``, 2 bytes, comes after the former is freed).

    ``per_chunk``: instead, what the probe head costs once per model call (0 without ``backward``): the float32
    copy of the head weight, V x H x 4 bytes, that ``HFProbeModel``'s float32 probe head keeps for the embeddings'
    gradient off CUDA for a weight that is not float32 (``_linear_float32``'s upcast path: the chunks are saved by
    their products); 0 on CUDA bf16 / fp16 (one float32-output ``mm`` on the weight itself), for a float32 weight
    and for other models. The head weight's own gradient is never built (the probe head detaches it)."""
    if per_chunk:
        head = None
        if backward and getattr(model, "probe_logits_float32", False):
            head = getattr(getattr(model, "model", None), "get_output_embeddings", lambda: None)()
        if not isinstance(head, torch.nn.Linear) or "forward" in head.__dict__:
            return 0
        w = head.weight
        cuda_mm = w.device.type == "cuda" and w.dtype in (torch.bfloat16, torch.float16)
        return 0 if w.dtype == torch.float32 or cuda_mm else 4 * w.numel()
    return (16 if backward else 8) * batch.keep * int(model.vocab_size)


def resident_bytes(model: ProbeModel, batch: ProbeBatch, engine: str, n_rows: int) -> int:
    """Bytes an engine keeps across its chunks, outside ``memory_budget_mb``, for ``n_rows`` rows scored: the
    scores and mask (B x L_max x 5), the clean probe logits (n_rows x K_max x V x 4, float32 at most) and, for
    ``engine`` ``"prefix"`` and ``"window"`` (also screened OAR-P, whose exact pass reuses the window's clean
    pass), the clean key/value cache (n_rows x T x ``kv_bytes_per_token``). ``"batched"``, ``"oar_g"``: no cache.

    Raises:
        ValueError: unknown ``engine``.
    """
    engines = ("batched", "prefix", "window", "oar_g")
    if engine not in engines:
        raise ValueError(f"engine must be one of {engines}, got {engine!r}")
    T, K = int(batch.input_ids.shape[1]), int(batch.answer_ids.shape[1])
    L = int(batch.reasoning_len.max()) if batch.batch_size else 0
    out = batch.batch_size * L * 5 + int(n_rows) * K * int(model.vocab_size) * 4
    if engine in ("prefix", "window"):
        out += int(n_rows) * T * int(model.kv_bytes_per_token())
    return out


def _warn_over(what: str, need: float, budget: int) -> None:
    """Warns that one item alone needs ``need`` bytes, more than ``budget``: the planners still run it (alone)."""
    if need > budget:
        _log.warning("memory planner: %s needs %.1f MiB, over memory_budget_mb = %d MiB: it runs alone, over the "
                     "budget (raise memory_budget_mb, or shorten the contexts)", what, need / 2**20, budget >> 20)


def plan_masked(model: ProbeModel, batch: ProbeBatch, widths: Sequence[int], counts: Sequence[int], budget: int,
                max_variants: int = 0, *, backward: bool = False, checkpoint: bool = False) -> list:
    """Chunks of the flattened variants of rows with context lengths ``widths`` and ``counts`` variants each (the
    variants of a row consecutive), every variant a full left-padded context (OAR-P batched, OAR-G).

    Args:
        widths, counts: per row, ints >= 0 (same length, non-empty).
        budget: bytes (:func:`budget_bytes`). max_variants: variants per chunk, 0 = no cap.
        backward: cost of forward + backward w.r.t. the embeddings (OAR-G) instead of a forward, plus OAR-G's
            float32 noise draw (H x 4) and score accumulator (4) per token.
        checkpoint: with ``backward``, the cost under the model's activation checkpointing
            (``checkpointed_activation_bytes_per_token``, :class:`~oar.attribution.model.CheckpointModel`).

    With ``backward`` the probe head's backward is counted too (issue 41, :func:`probe_bytes`): per variant
    ``probe_bytes(..., backward=True)`` (the probe logits' float32 gradients), and once per chunk
    ``probe_bytes(..., backward=True, per_chunk=True)`` (the head's float32 weight copy on the upcast path): the C++
    planner has no per-chunk term, so it packs against ``budget`` minus that constant.

    Returns:
        ``MaskedChunk`` list; ``max_context_len`` is the chunk's padded width. Logs a warning when one variant of
        the widest row alone (with the per-chunk term) exceeds the budget.
    """
    bytes_tok = masked_bytes_per_token(model, max(widths), backward=backward, checkpoint=checkpoint)
    per_var = probe_bytes(model, batch, backward=backward)
    fixed = probe_bytes(model, batch, backward=backward, per_chunk=True)
    _warn_over(f"one {'row (forward + backward)' if backward else 'variant'} of {max(widths)} tokens",
               max(widths) * bytes_tok + per_var + fixed, budget)
    return _C.plan_masked_chunks(list(widths), list(counts), bytes_tok, per_var, max(1, budget - fixed), max_variants)


def masked_bytes_per_token(model: ProbeModel, width: int, *, backward: bool = False, checkpoint: bool = False) -> int:
    """Bytes per context token of :func:`plan_masked`'s cost model (see there) for contexts of ``width`` tokens."""
    if not backward:
        return int(model.activation_bytes_per_token(width))
    act = (model.checkpointed_activation_bytes_per_token(width) if checkpoint
           else model.activation_bytes_per_token(width, backward=True))
    return int(act) + 4 * int(model.hidden_size) + 4


def plan_clean(model: ProbeModel, batch: ProbeBatch, n_rows: int, budget: int, *, cache: bool = True,
               prompt_once: bool = False) -> list:
    """Chunks of ``n_rows`` >= 1 full-width (T) clean contexts, run with their key/value cache kept (``cache``: the
    clean pass of the prefix and windowed engines) or not (the clean logits of batched OAR-P and OAR-G). With
    ``prompt_once`` (the prompt-once clean pass) the cache counts twice: the rows' gathered prompt prefix lives
    beside their full cache. Returns a ``MaskedChunk`` list; logs a warning when one row alone exceeds the budget."""
    T = int(batch.input_ids.shape[1])
    copies = (2 if prompt_once else 1) if cache else 0
    bytes_tok = int(model.activation_bytes_per_token(T)) + (copies * int(model.kv_bytes_per_token()) if copies else 0)
    _warn_over(f"one clean row of {T} tokens", T * bytes_tok + probe_bytes(model, batch), budget)
    return _C.plan_masked_chunks([T] * n_rows, [1] * n_rows, bytes_tok, probe_bytes(model, batch), budget, 0)


def plan_prefix(model: ProbeModel, batch: ProbeBatch, columns: Sequence[int], budget: int, max_variants: int,
                max_prefix_waste: float) -> list:
    """Chunks of variants sorted by masked column (``columns``, non-decreasing, in [0, T)), each run on the clean
    cache of its smallest column (prefix-cached OAR-P).

    Args:
        columns: masked column of each variant. budget: bytes. max_variants: 0 = no cap.
        max_prefix_waste: in (0, 1], the share of a chunk's run columns it may recompute in vain.

    Returns:
        ``PrefixChunk`` list; ``prefix_len`` is the chunk's smallest column. Logs a warning when the variant of the
        smallest column alone exceeds the budget.
    """
    T = int(batch.input_ids.shape[1])
    act, kv = int(model.activation_bytes_per_token(T)), int(model.kv_bytes_per_token())
    if len(columns):
        p = int(min(columns))
        _warn_over(f"one variant masking column {p} of {T}", (T - p) * act + p * kv + probe_bytes(model, batch), budget)
    return _C.plan_prefix_chunks(list(columns), T, act, kv, probe_bytes(model, batch), budget, max_variants,
                                 float(max_prefix_waste))


def plan_window(model: ProbeModel, batch: ProbeBatch, n_variants: int, rerun: int, budget: int, *,
                shared: bool) -> list:
    """Chunks of ``n_variants`` >= 1 windowed OAR-P variants that each re-run at most ``rerun`` columns on their row's
    clean cache.

    Per variant: cache bytes of ``rerun`` columns with shared-prefix attention (the row's cache is read in place),
    else of 3 T + 2 ``rerun`` columns (the row's T-column cache copied per variant, then concatenated with the re-run
    columns, and one more for the keys and values repeated to every head under grouped-query attention, one layer
    at a time: at most all layers' worth when heads / kv_heads <= layers), the activations of the re-run columns over a (T + rerun)-wide context, the masks
    and the probe logits. Masks: with shared-prefix attention what the model declares
    (``model.window_mask_bytes(rerun, T)``: FlexAttention reads the closed form, O(rerun), the CPU kernel expands it
    to biases); else, and for models that declare nothing, dense masks over rerun x (T + rerun) (query, key) pairs
    (the additive mask in the cache's dtype, ``cache_key_element_size()`` when the model declares it, else 4 bytes,
    plus three bool masks it is built from).

    Returns:
        ``MaskedChunk`` list (``max_context_len`` 0: every variant costs the same). Logs a warning when one variant
        alone exceeds the budget.
    """
    T = int(batch.input_ids.shape[1])
    kv_tok = int(model.kv_bytes_per_token())
    key_size = getattr(model, "cache_key_element_size", None)
    mask_bpe = int(key_size()) if callable(key_size) else 4
    declared = getattr(model, "window_mask_bytes", None)
    if shared and callable(declared):
        mask = int(declared(rerun, T))
    else:
        mask = (mask_bpe + 3) * rerun * (T + rerun)
    per_var = ((rerun if shared else 3 * T + 2 * rerun) * kv_tok
               + rerun * int(model.activation_bytes_per_token(T + rerun)) + mask + probe_bytes(model, batch))
    _warn_over(f"one windowed variant re-running {rerun} of {T} columns", per_var, budget)
    return _C.plan_masked_chunks([0], [n_variants], 0, per_var, budget, 0)


def plan_entropy(vocab_size: int, keep: int, n_rows: int, budget: int) -> list:
    """Chunks of ``n_rows`` >= 1 contexts whose last ``keep`` positions run the LM head for their entropies: each row
    costs keep x ``vocab_size`` x 12 bytes (float32 logits, log-softmax and their product). Returns a ``MaskedChunk``
    list."""
    return _C.plan_masked_chunks([keep] * n_rows, [1] * n_rows, 12 * int(vocab_size), 0, budget, 0)
