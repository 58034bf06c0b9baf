"""The one chunk planner of the attribution engines: every engine cuts its work into model calls here.

Each engine has a cost model (bytes one chunk needs, from the model's declared costs:
``activation_bytes_per_token``, ``kv_bytes_per_token``, ``vocab_size``) and a budget (``memory_budget_mb``, in
bytes via :func:`budget_bytes`); the greedy packing itself is C++ (``oar._C.plan_masked_chunks``,
``oar._C.plan_prefix_chunks``, ``src/core/masked_batch.cpp``, shared with the C++ engine). This module is Python
because the cost models read a Python :class:`~oar.attribution.model.ProbeModel`; it only turns them into the
planners' per-token / per-variant bytes, so every plan of the package comes from the same two C++ planners.

Cost models (bytes a chunk may use, compared with the budget):

- masked contexts (:func:`plan_masked`: OAR-P batched, OAR-G): variants x (padded width x activation bytes per
  token + probe bytes per variant);
- clean pass with cache (:func:`plan_clean`): rows x (T x (activation + cache bytes per token) + probe bytes);
- prefix-cached OAR-P (:func:`plan_prefix`): variants x ((T - prefix) x activation + prefix x cache bytes + probe
  bytes), chunks also bounded by ``max_prefix_waste``;
- windowed OAR-P (:func:`plan_window`): variants x a fixed per-variant cost (re-run columns, copied cache, 4-D mask,
  probe bytes);
- policy entropies (:func:`plan_entropy`): rows x kept positions x V x 12 bytes (float32 logits, log-softmax and
  their product).

A chunk always takes its first item, even one over the budget (the caller then runs it alone). The plans are lists
of the C++ chunk objects: ``MaskedChunk`` (``begin``, ``end``, ``max_context_len``) or ``PrefixChunk`` (``begin``,
``end``, ``prefix_len``), item ranges [begin, end) in the order given.
"""

from __future__ import annotations

from typing import Sequence

from oar import _args
from oar._lib import load_extension
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeModel

_C = load_extension()

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


def probe_bytes(model: ProbeModel, batch: ProbeBatch) -> int:
    """Bytes of one variant's probe logits: ``keep`` positions x V, 8 bytes each (the logits and their float32 copy
    in the divergence)."""
    return 8 * batch.keep * int(model.vocab_size)


def plan_masked(model: ProbeModel, batch: ProbeBatch, widths: Sequence[int], counts: Sequence[int], budget: int,
                max_variants: int = 0, *, backward: bool = False) -> list:
    """Chunks of the flattened variants of rows with context lengths ``widths`` and ``counts`` variants each (the
    variants of a row consecutive), every variant a full left-padded context (OAR-P batched, OAR-G).

    Args:
        widths, counts: per row, ints >= 0 (same length, non-empty).
        budget: bytes (:func:`budget_bytes`). max_variants: variants per chunk, 0 = no cap.
        backward: cost of forward + backward w.r.t. the embeddings (OAR-G) instead of a forward.

    Returns:
        ``MaskedChunk`` list; ``max_context_len`` is the chunk's padded width.
    """
    bytes_tok = int(model.activation_bytes_per_token(max(widths), backward=True) if backward
                    else model.activation_bytes_per_token(max(widths)))
    return _C.plan_masked_chunks(list(widths), list(counts), bytes_tok, probe_bytes(model, batch), budget,
                                 max_variants)


def plan_clean(model: ProbeModel, batch: ProbeBatch, n_rows: int, budget: int) -> list:
    """Chunks of ``n_rows`` >= 1 full-width (T) clean contexts run with their key/value cache kept (the clean pass of
    the prefix and windowed engines). Returns a ``MaskedChunk`` list."""
    T = int(batch.input_ids.shape[1])
    bytes_tok = int(model.activation_bytes_per_token(T)) + int(model.kv_bytes_per_token())
    return _C.plan_masked_chunks([T] * n_rows, [1] * n_rows, bytes_tok, probe_bytes(model, batch), budget, 0)


def plan_prefix(model: ProbeModel, batch: ProbeBatch, columns: Sequence[int], budget: int, max_variants: int,
                max_prefix_waste: float) -> list:
    """Chunks of variants sorted by masked column (``columns``, non-decreasing, in [0, T)), each run on the clean
    cache of its smallest column (prefix-cached OAR-P).

    Args:
        columns: masked column of each variant. budget: bytes. max_variants: 0 = no cap.
        max_prefix_waste: in (0, 1], the share of a chunk's run columns it may recompute in vain.

    Returns:
        ``PrefixChunk`` list; ``prefix_len`` is the chunk's smallest column.
    """
    T = int(batch.input_ids.shape[1])
    return _C.plan_prefix_chunks(list(columns), T, int(model.activation_bytes_per_token(T)),
                                 int(model.kv_bytes_per_token()), probe_bytes(model, batch), budget, max_variants,
                                 float(max_prefix_waste))


def plan_window(model: ProbeModel, batch: ProbeBatch, n_variants: int, rerun: int, budget: int, *,
                shared: bool) -> list:
    """Chunks of ``n_variants`` >= 1 windowed OAR-P variants that each re-run at most ``rerun`` columns on their row's
    clean cache.

    Per variant: cache bytes of ``rerun`` columns with shared-prefix attention (the row's cache is read in place),
    else of 2 T + ``rerun`` columns (the row's T-column cache copied per variant, then concatenated with the re-run
    columns), the activations of the re-run columns over a
    (T + rerun)-wide context, the float32 4-D mask (rerun x (T + rerun)) and the probe logits.

    Returns:
        ``MaskedChunk`` list (``max_context_len`` 0: every variant costs the same).
    """
    T = int(batch.input_ids.shape[1])
    kv_tok = int(model.kv_bytes_per_token())
    per_var = ((rerun if shared else 2 * T + rerun) * kv_tok
               + rerun * int(model.activation_bytes_per_token(T + rerun)) + 4 * rerun * (T + rerun)
               + probe_bytes(model, batch))
    return _C.plan_masked_chunks([0], [n_variants], 0, per_var, budget, 0)


def plan_entropy(vocab_size: int, keep: int, n_rows: int, budget: int) -> list:
    """Chunks of ``n_rows`` >= 1 contexts whose last ``keep`` positions run the LM head for their entropies: each row
    costs keep x ``vocab_size`` x 12 bytes (float32 logits, log-softmax and their product). Returns a ``MaskedChunk``
    list."""
    return _C.plan_masked_chunks([keep] * n_rows, [1] * n_rows, 12 * int(vocab_size), 0, budget, 0)
