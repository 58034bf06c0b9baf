"""OAR scores computed where a trainer's policy lives (verl's actor workers, OpenRLHF's policy actors): the one
path both adapters use.

Driver side: :func:`split_rows` assigns the batch rows to the data-parallel ranks in contiguous chunks
(:class:`RankSplit`), the adapter sends each rank its chunk its own way (verl's dispatch, OpenRLHF's
``async_run_method_batch``), and :meth:`RankSplit.place` puts the returned chunks back in batch row order.

Rank side: :func:`score_chunk` scores one chunk with the rank's policy: the process's cached pipeline of the
driver's config (:func:`oar.pipeline_cache.pipeline_for`; OAR-G's noise draws advance from step to step and every
rank draws the same sequence), its chunk budget capped by the trainer's own forward budget
(:func:`trainer_budget_mb`), the policy in eval mode with gradients enabled (OAR-G's backward w.r.t. the input
embeddings; no parameter ``.grad`` is written). Every rank runs one call per step; the pipeline's forward gate
keeps their policy forwards in step (FSDP / ZeRO-3 gather parameters in every forward).

What stays in each adapter: how the rows arrive (verl ``TensorDict`` requests, OpenRLHF ``RolloutBatch`` chunks)
and which model, tokenizer, eval mode and token budget the trainer has. Nothing here imports a trainer framework.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from oar.batch import RolloutBatch
from oar.pipeline import scored_rows
from oar.pipeline_cache import pipeline_for
from oar.schema import OARConfig


@dataclass(frozen=True)
class RankSplit:
    """Rows of a batch assigned to data-parallel ranks (:func:`split_rows`).

    Attributes:
        rows: the batch row of each request row; the request rows after the first ``sent`` are padding (they
            repeat the first sent row with sequence advantage 0, so they are not scored).
        sent: number of real request rows.
        bounds: ``ranks + 1`` offsets: rank k gets request rows ``bounds[k]:bounds[k + 1]`` (contiguous chunks).
    """

    rows: list[int]
    sent: int
    bounds: list[int]

    def sequence_advantages(self, sequence_advantages: torch.Tensor) -> torch.Tensor:
        """(n,) float32 CPU: the request rows' sequence advantages (0 on the padding rows)."""
        adv = sequence_advantages.detach().float().cpu().reshape(-1)[self.rows].clone()
        adv[self.sent:] = 0.0
        return adv

    def place(self, values: torch.Tensor, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
        """(batch_size, ...) ``dtype`` CPU tensor with the first ``sent`` rows of ``values`` (the request rows'
        results, in request order) at their batch rows, zeros elsewhere."""
        out = torch.zeros((batch_size, *values.shape[1:]), dtype=dtype)
        out[torch.tensor(self.rows[: self.sent], dtype=torch.int64)] = values[: self.sent].to(dtype).cpu()
        return out


def split_rows(sequence_advantages: torch.Tensor, ranks: int, *, only_scored: bool,
               credit_rows: str = "all") -> RankSplit:
    """Contiguous chunks of a batch's rows, one per data-parallel rank.

    Args:
        sequence_advantages: (B,) real, the rows' sequence advantages (rows at exactly 0 are never scored).
        ranks: number of data-parallel ranks (int >= 1).
        only_scored: True: only the rows the pipeline scores are sent (:func:`oar.pipeline.scored_rows`: a non-zero
            advantage, of the sign ``credit_rows`` credits), padded to a multiple of ``ranks`` (equal
            chunks, as verl's dispatch needs); False: all B rows, chunk k = rows round(k B / ranks) ..
            round((k + 1) B / ranks) (OpenRLHF's per-actor requests).
        credit_rows: the config's ``credit_rows`` (``"all"``, ``"positive"``, ``"negative"``); used with
            ``only_scored``.

    Returns:
        :class:`RankSplit`.

    Raises:
        ValueError: ``ranks`` not an int >= 1; ``credit_rows`` unknown; ``only_scored`` with no row to score.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    adv = sequence_advantages.detach().float().cpu().reshape(-1)
    if only_scored:
        sent = scored_rows(adv, credit_rows)
        if not sent:
            raise ValueError(f"split_rows(only_scored=True) needs at least one row to score (a non-zero sequence "
                             f"advantage, credit_rows={credit_rows!r})")
        n = -(-len(sent) // ranks) * ranks
        rows = sent + [sent[0]] * (n - len(sent))
    else:
        rows = list(range(adv.numel()))
        n = len(rows)
    return RankSplit(rows=rows, sent=len(sent) if only_scored else n,
                     bounds=[round(k * n / ranks) for k in range(ranks + 1)])


def token_budget_mb(probe_model, tokens: int, width: int) -> int:
    """The memory (MiB, >= 1) a trainer budgets for ``tokens`` tokens of one inference forward over contexts of
    ``width`` tokens: ``tokens x (probe_model.activation_bytes_per_token(width) + 4 x vocab_size)`` (activations
    plus float32 logits). Adapters cap OAR's chunk budget with it (``Pipeline.memory_budget_cap_mb``): the trainer
    sized its own log-prob micro-batches to fit next to what the device already holds (parameters, optimizer
    state, a colocated vLLM), so OAR's chunks fit there too.

    Args:
        probe_model: the policy as an ``oar.attribution.ProbeModel``.
        tokens: the trainer's token budget per forward (> 0). width: the longest context (> 0).
    """
    per_token = int(probe_model.activation_bytes_per_token(int(width))) + 4 * int(probe_model.vocab_size)
    return max(1, int(tokens) * per_token // 2**20)


def trainer_budget_mb(probe_model, width: int, *, dynamic: bool, max_tokens: int | None,
                      micro_batch_size: int | None) -> int | None:
    """The activation memory (MiB, >= 1; :func:`token_budget_mb`) a trainer lets one rank's inference forward use:
    ``max_tokens`` tokens with dynamic batch sizes (``dynamic`` and ``max_tokens`` set), else ``micro_batch_size``
    sequences of ``width`` tokens; None when the trainer states neither.

    Args:
        probe_model: the policy as an ``oar.attribution.ProbeModel``.
        width: the longest context of the chunk (prompt + response tokens, >= 1).
        dynamic: the trainer packs its forwards by token count. max_tokens: its token budget per forward.
        micro_batch_size: its sequences per forward otherwise.
    """
    if dynamic and max_tokens:
        tokens = int(max_tokens)
    elif micro_batch_size:
        tokens = int(micro_batch_size) * int(width)
    else:
        return None
    return token_budget_mb(probe_model, tokens, width)


@dataclass(frozen=True)
class ChunkScores:
    """:func:`score_chunk`'s result: ``scores`` (n, R) float32 and ``reasoning_mask`` (n, R) bool on the CPU (rows
    with sequence advantage 0 unscored: 0 / False), ``memory_budget_mb`` the chunk budget the pipeline ran with,
    ``turn_weights`` (n, R) float32 CPU or None: :attr:`oar.batch.TokenScores.turn_weights` (multi-turn rows,
    docs/method.md section 13), which the driver passes on with the scores."""

    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    memory_budget_mb: int
    turn_weights: torch.Tensor | None = None


def score_chunk(config: str | OARConfig, tokenizer, batch: RolloutBatch, model, *,
                budget_cap_mb: int | None = None, eval_mode: Callable[[], ContextManager] | None = None,
                scope=None, by_name: bool = False) -> ChunkScores:
    """Scores one rank's chunk of rows with this rank's policy.

    Args:
        config: the driver's ``oar.OARConfig`` or its JSON (the rank scores with the driver's method and settings).
        tokenizer: the policy's tokenizer (reasoning span, probe contexts).
        batch: the chunk's :class:`RolloutBatch` (completions, prompts, eligible mask, answers, sequence
            advantages).
        model: the policy (Hugging Face causal LM, an FSDP module, or a ProbeModel).
        budget_cap_mb: the trainer's own forward budget (MiB) capping the config's ``memory_budget_mb``
            (:func:`trainer_budget_mb`), or None for no cap.
        eval_mode: context manager factory that puts the policy in evaluation mode (and back) around the scoring;
            None: none.
        scope / by_name: where the pipeline is cached (:func:`oar.pipeline_cache.pipeline_for`; default: per
            tokenizer object). ``by_name``: the tokenizer was unpickled with the request, cache by its identity.

    Returns:
        :class:`ChunkScores`.

    Raises:
        ValueError: as :meth:`oar.pipeline.Pipeline.scores` (a method's missing input, shapes).
    """
    cfg = OARConfig.from_json(config) if isinstance(config, str) else config
    pipe = pipeline_for(cfg, tokenizer, scope=scope, by_name=by_name)
    pipe.memory_budget_cap_mb = budget_cap_mb
    with eval_mode() if eval_mode is not None else contextlib.nullcontext():  # OAR-G enables grad for itself
        res = pipe.scores(batch, model)
    tw = None if res.turn_weights is None else res.turn_weights.detach().float().cpu()
    return ChunkScores(res.scores.detach().float().cpu(), res.reasoning_mask.detach().bool().cpu(),
                       int(pipe.memory_budget_mb), tw)
