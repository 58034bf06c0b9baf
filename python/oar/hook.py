"""Framework-agnostic token-advantage hook: sequence advantages in, per-token advantages out.

The contract every trainer adapter relies on (docs/trainers.md): input sequence advantages A (B,),
the rollouts' prompt and completion ids, an eligible mask (B, C) (completion tokens that carry loss) and
the reference answers; output (B, C) float32 with zero on ineligible tokens, A_tok = A * w, w >= 0, and
masked sum of A_tok = A * (number of eligible tokens). Scores are computed once per generation batch
with the behaviour policy, detached.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from oar import ops
from oar._lib import load_extension
from oar.attribution import (
    DEFAULT_MARKERS,
    ProbeContextBuilder,
    as_probe_model,
    entropy_scores,
    oar_g_scores,
    oar_p_scores,
    random_scores,
    reasoning_length,
)
from oar.metrics import ess_ratio, top_mass

_C = load_extension()


@dataclass
class TokenAdvantages:
    """Output of :meth:`TokenAdvantageHook.compute`.

    Attributes:
        advantages: (B, C) float32 per-token advantages (0 on ineligible tokens).
        weights: (B, C) float32 reshaping weights (1 outside the reasoning span, 0 on ineligible tokens).
        scores: (B, C) float32 raw importance scores on reasoning tokens (0 elsewhere).
        reasoning_mask: (B, C) bool, the reasoning tokens that were scored.
        metrics: scalars (``oar/ess_ratio``, ``oar/top10_mass``, ``oar/reasoning_frac``,
            ``oar/skipped_rows_frac``, ``oar/attribution_seconds``, ``oar/forward_passes``).
    """

    advantages: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    metrics: dict = field(default_factory=dict)
    #: (B,) float32 sequence advantages the token advantages were built from (set by :func:`oar.token_advantages`).
    sequence_advantages: torch.Tensor | None = None


class TokenAdvantageHook:
    """Turns GRPO sequence advantages into OAR per-token advantages (method.md sections 2-6).

    Args:
        config: ``oar.OARConfig`` (method, probe, reshape, sigma, noise_draws, conclude, budget, seed).
        tokenizer: the policy's Hugging Face tokenizer.
        markers: final-answer markers that end the reasoning span.
        pad_id: PAD id for OAR-P masking (default: tokenizer pad, then eos).

    The hook skips rollouts whose sequence advantage is exactly 0 (their token advantages are 0 whatever
    the weights) and reports the skipped share as ``oar/skipped_rows_frac``.
    """

    def __init__(self, config, tokenizer, markers: Sequence[str] = DEFAULT_MARKERS, pad_id: int | None = None,
                 sync_forwards: bool | None = None):
        # sync_forwards: keep attribution forwards in step across ranks (oar.distributed.ForwardGate); None =
        # whenever torch.distributed runs with more than one process (required under ZeRO-3 / FSDP).
        self.sync_forwards = sync_forwards
        self.config = config
        self.tokenizer = tokenizer
        self.builder = ProbeContextBuilder(tokenizer, config.conclude, config.answer_suffix, pad_id=pad_id,
                                           markers=markers)
        self._generator = torch.Generator().manual_seed(int(config.seed))
        self.calls = 0

    def reasoning_lengths(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[int]:
        """L_i of each completion row (right-padded completions, mask 1 on real tokens)."""
        out = []
        for i in range(completion_ids.shape[0]):
            ids = completion_ids[i][completion_mask[i].bool()].tolist()
            out.append(reasoning_length(ids, self.tokenizer, self.builder.markers, self.builder.stop_ids))
        return out

    @staticmethod
    def _check_token_ids(cids: torch.Tensor, cmask: torch.Tensor, prompt_ids: Sequence, rows: list[int],
                         vocab: int) -> None:
        """Completion tokens (under the mask) and prompts of ``rows`` must be ids in [0, vocab) (vocab 0: only
        >= 0 is checked); otherwise decoding or the embedding fails with an opaque error."""
        hi = vocab if vocab > 0 else None
        sel = cids[rows][cmask[rows]]
        if sel.numel() and (int(sel.min()) < 0 or (hi is not None and int(sel.max()) >= hi)):
            bad = int(sel.min()) if int(sel.min()) < 0 else int(sel.max())
            r, c = torch.nonzero((cids == bad) & cmask)[0].tolist()
            raise ValueError(f"completion_ids must be token ids in [0, {hi or 'inf'}), got {bad} at [{r}, {c}]")
        for i in rows:
            p = prompt_ids[i]
            if isinstance(p, torch.Tensor):
                p = p.detach().cpu()
                if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                    raise ValueError(f"prompt_ids[{i}] must be a 1-D integer tensor of token ids, got shape "
                                     f"{tuple(p.shape)} and dtype {p.dtype}")
            else:
                vals = list(p)
                for j, x in enumerate(vals):
                    if isinstance(x, (bool, float)) or not hasattr(x, "__index__"):
                        raise ValueError(f"prompt_ids[{i}] must hold integer token ids, got {x!r} at position {j}")
                p = torch.tensor([int(x) for x in vals], dtype=torch.long)
            if p.numel() == 0:
                continue
            bad = (p < 0) | (p >= hi) if hi is not None else p < 0
            if bool(bad.any()):
                j = int(torch.nonzero(bad)[0])
                raise ValueError(f"prompt_ids[{i}] must be token ids in [0, {hi or 'inf'}), got {int(p[j])} at "
                                 f"position {j}")

    def compute(self, model, prompt_ids: Sequence, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                advantages: torch.Tensor, answers: Sequence[str], eligible_mask: torch.Tensor | None = None,
                rewards: torch.Tensor | None = None, group_offsets=None) -> TokenAdvantages:
        """Per-token advantages for one generation batch.

        Args:
            model: the policy (HF causal LM or a ProbeModel); used without touching parameter grads.
            prompt_ids: B unpadded prompt id sequences (lists or 1-D tensors).
            completion_ids: (B, C) int64, right-padded completions.
            completion_mask: (B, C) 0/1 or bool, 1 on completion tokens (TRL's completion_mask).
            advantages: (B,) float sequence advantages.
            answers: B reference answers (strings).
            eligible_mask: (B, C) tokens that carry loss (default completion_mask; e.g. completion_mask *
                tool_mask). Reasoning tokens outside it are not scored.
            rewards, group_offsets: (B,) rewards and the groups (CSR offsets (G + 1,) or an int group size);
                used by method "ktae" (correctness and per-group token tables; see oar.baselines) and, when
                given, for the ``oar/skipped_groups_frac`` metric (groups whose advantages are all 0: no
                attribution runs for them).

        Methods "entropy_shaping" and "ktae" add a bonus to A instead of reshaping (method.md section 8; no
        sum preservation); "dr_grpo" gives uniform credit like "grpo".

        Returns:
            :class:`TokenAdvantages` on ``advantages.device``.
        Raises:
            ValueError: arguments that are not tensors, mismatched shapes (naming the argument), non-integer
                completion_ids, token ids outside [0, vocab_size), non-finite advantages or token advantages
                beyond float32 range, unknown method.
        """
        t0 = time.perf_counter()
        for name, t in (("completion_ids", completion_ids), ("completion_mask", completion_mask),
                        ("advantages", advantages), ("eligible_mask", eligible_mask)):
            if t is None and name == "eligible_mask":
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type == "meta":
                raise ValueError(f"{name} must hold data, got a tensor on the meta device")
        if completion_ids.dim() != 2:
            raise ValueError(f"completion_ids must be (B, C), got shape {tuple(completion_ids.shape)}")
        if completion_ids.dtype.is_floating_point or completion_ids.dtype.is_complex or completion_ids.dtype == torch.bool:
            raise ValueError(f"completion_ids must be an integer tensor of token ids, got dtype {completion_ids.dtype}")
        B, C = completion_ids.shape
        if completion_mask.shape != (B, C):
            raise ValueError(f"completion_mask must be (B, C) = {(B, C)}, got {tuple(completion_mask.shape)}")
        if advantages.shape != (B,):
            raise ValueError(f"advantages must be (B,) = ({B},), got {tuple(advantages.shape)}")
        if len(prompt_ids) != B or len(answers) != B:
            raise ValueError(f"prompt_ids and answers must have B = {B} entries, got {len(prompt_ids)} and {len(answers)}")
        out_dev = advantages.device
        eligible = (completion_mask if eligible_mask is None else eligible_mask).bool().cpu()
        if eligible.shape != (B, C):
            raise ValueError(f"eligible_mask must be (B, C) = {(B, C)}, got {tuple(eligible.shape)}")
        raw = advantages.detach().cpu()
        if raw.dtype.is_complex:
            raise ValueError(f"advantages must be real, got dtype {raw.dtype}")
        if not torch.isfinite(raw).all():
            raise ValueError("advantages must be finite; got NaN/Inf at rows "
                             f"{torch.nonzero(~torch.isfinite(raw)).flatten().tolist()[:8]}")
        adv = raw.float()
        if not torch.isfinite(adv).all():  # finite float64 beyond float32 range
            raise ValueError("advantages must fit in float32 (|A| <= 3.4e38); got larger values at rows "
                             f"{torch.nonzero(~torch.isfinite(adv)).flatten().tolist()[:8]}")
        method = self.config.method
        if method in ("entropy_shaping", "ktae"):
            from oar.api import additive_baseline

            return additive_baseline(self, model, prompt_ids, completion_ids, completion_mask, adv, eligible, out_dev,
                                     t0, rewards=rewards, group_offsets=group_offsets)
        gate = None
        if method in ("oar_p", "oar_g", "entropy"):
            from oar.distributed import ForwardGate, distributed_world

            if self.sync_forwards or (self.sync_forwards is None and distributed_world()):
                gate = ForwardGate(as_probe_model(model), pad_id=self.builder.pad_id)
        scores = torch.zeros((B, C), dtype=torch.float32)
        reasoning = torch.zeros((B, C), dtype=torch.bool)
        stats: dict = {}
        active = [i for i in range(B) if float(adv[i]) != 0.0]
        if method not in ("grpo", "dr_grpo") and active:
            cids = completion_ids.detach().cpu()
            cmask = completion_mask.detach().bool().cpu()
            pm = (gate if gate is not None else as_probe_model(model)) if method != "random" else None
            vocab = int(getattr(pm, "vocab_size", 0) or 0) if pm is not None else 0
            self._check_token_ids(cids, cmask, prompt_ids, active, vocab)
            lens = self.reasoning_lengths(cids, cmask)
            responses = [cids[i][cmask[i]] for i in range(B)]
            prompts = [p.detach().cpu() if isinstance(p, torch.Tensor) else p for p in prompt_ids]
            batch = self.builder.build([prompts[i] for i in active], [responses[i] for i in active],
                                       [answers[i] for i in active], [lens[i] for i in active])
            ctx = pm.eval_mode() if pm is not None and hasattr(pm, "eval_mode") else contextlib.nullcontext()
            with ctx:
                if method == "oar_p":
                    att = oar_p_scores(pm, batch, probe=self.config.probe, memory_budget_mb=self.config.memory_budget_mb,
                                       max_variants_per_chunk=self.config.max_variants_per_chunk)
                elif method == "oar_g":
                    att = oar_g_scores(pm, batch, probe=self.config.probe, sigma=self.config.sigma,
                                       noise_draws=self.config.noise_draws, generator=self._generator,
                                       memory_budget_mb=self.config.memory_budget_mb)
                elif method == "entropy":
                    att = entropy_scores(pm, batch)
                elif method == "random":
                    att = random_scores(batch, generator=self._generator)
                else:
                    raise ValueError(f"config.method {method!r} is not an attribution method")
            stats = att.stats
            for k, i in enumerate(active):
                L = int(batch.reasoning_len[k])
                cols = torch.nonzero(cmask[i]).flatten()[:L]
                scores[i, cols] = att.scores[k, :L]
                reasoning[i, cols] = True
            reasoning &= eligible
        if gate is not None:
            gate.finish()  # dummy forwards until every rank is done (collective: also on ranks with no rows)
            stats = dict(stats, padding_forwards=sum(gate.dummy_calls.values()))
        r = self.config.reshape
        tok_adv, weights = ops.reshape_advantages(adv, scores, reasoning, eligible, q=r.q, beta=r.beta, floor=r.floor,
                                                  tiers=r.tiers)
        self.calls += 1
        rows = torch.tensor(active, dtype=torch.long)
        metrics = {
            "oar/ess_ratio": float(ess_ratio(weights[rows], eligible[rows]).mean()) if active else 1.0,
            "oar/top10_mass": float(top_mass(tok_adv[rows], weights[rows], eligible[rows], 0.1).mean()) if active else 0.1,
            "oar/reasoning_frac": float(reasoning.sum() / eligible.sum().clamp_min(1)),
            "oar/skipped_rows_frac": 1.0 - len(active) / max(B, 1),
            **_skipped_groups(adv, group_offsets),
            "oar/forward_passes": float(stats.get("forward_passes", 0)),
            "oar/padding_forwards": float(stats.get("padding_forwards", 0)),
            "oar/attribution_seconds": time.perf_counter() - t0,
        }
        return TokenAdvantages(tok_adv.to(out_dev), weights.to(out_dev), scores.to(out_dev), reasoning.to(out_dev), metrics)


def _skipped_groups(adv: torch.Tensor, group_offsets) -> dict:
    """{"oar/skipped_groups_frac": share of groups whose sequence advantages are all exactly 0} when the groups
    are known (an int group size dividing B, or CSR offsets (G + 1,), resolved as by ops.group_advantages);
    {} otherwise (the metric is then omitted rather than guessed)."""
    if group_offsets is None or adv.shape[0] == 0:
        return {}
    size = group_offsets if isinstance(group_offsets, int) and not isinstance(group_offsets, bool) else None
    try:
        off = ops._resolve_offsets(adv, None if size is not None else group_offsets, None, size).tolist()
    except ValueError:
        return {}
    if len(off) < 2 or off[0] != 0 or off[-1] != adv.shape[0] or any(b < a for a, b in zip(off, off[1:])):
        return {}
    groups = [(a, b) for a, b in zip(off, off[1:]) if b > a]
    skipped = sum(bool((adv[a:b] == 0).all()) for a, b in groups)
    return {"oar/skipped_groups_frac": skipped / max(len(groups), 1)}
