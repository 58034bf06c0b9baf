"""OAR-P (method.md sections 2-3): each reasoning token's probe divergence when it is masked, reshaped (sections
5-6). Exact (every eligible reasoning token masked), or screened (config ``screen_fraction`` < 1; docs/design.md
"Screened OAR-P"): a cheap screen ranks the tokens, exact masking runs on the top share plus a random sample, and
``screen_budget`` may cut the share so that a step stays within a multiple of the GRPO step."""

from __future__ import annotations

import logging
import time

from oar.attribution import (linear_tail_support, oar_g_scores, oar_p_linear_tail_scores, oar_p_scores,
                             oar_p_window_scores, probe_capabilities)
from oar.attribution.screened import budget_fraction, oar_p_screened_scores
from oar.attribution.spans import span_sums
from oar.methods.base import RESHAPE, MethodSpec, Step, TokenScorer

_log = logging.getLogger("oar")


class OARPScorer(TokenScorer):
    """OAR-P scores of the eligible reasoning tokens, exact or screened (state: the exact pass's measured seconds per
    token, which the time budget reads on the next call). Masks the pipeline's spans itself (``Step.spans``: one variant
    per span, docs/method.md section 11)."""

    masks_spans = True

    def __init__(self, config):
        self.config = config
        self.exact_s_per_token: float | None = None
        self._warned_screen = False  # the window screen fell back to OAR-G (warned once)

    def score(self, step: Step, pm, pbatch, positions):
        cfg = self.config
        kw = dict(probe=cfg.probe, memory_budget_mb=step.memory_budget_mb,
                  max_variants_per_chunk=cfg.max_variants_per_chunk)
        if step.spans is not None:  # the spans already leave out the tokens that are not eligible
            positions, kw["spans"] = None, step.spans
        if cfg.screen_fraction < 1:
            return self._screened(step, pm, pbatch, positions, kw)
        return oar_p_scores(pm, pbatch, rows=step.active, positions=positions, **kw)

    def _screened(self, step: Step, pm, pbatch, positions, kw):
        """The screen (config ``screen``: windowed OAR-P with ``screen_window``, or OAR-G with the config's sigma and
        noise draws), then exact masking of the selection. A model without the prefix-cache capability (sliding-window
        or recurrent layers), or one whose attention takes no 4-D mask (flash attention) and has no shared-prefix
        attention, cannot run the window screen: OAR-G screens instead (warned once). ``screen_tail: linear`` runs
        :func:`~oar.attribution.oar_p_linear_tail_scores` (its own forward: flash attention is fine) and raises
        ValueError naming the reason for a model it cannot run (:func:`~oar.attribution.linear_tail_support`). With
        ``screen_fraction = screen_sample = 0`` the screen's scores are the result (windowed OAR-P: nothing is masked
        exactly, no calibration; the reshaping normalizes each row's scores anyway)."""
        cfg = self.config
        screen_only = cfg.screen_fraction == 0 and cfg.screen_sample == 0
        kind = cfg.screen
        if kind == "window" and cfg.screen_tail == "linear":
            why = linear_tail_support(pm)
            if why is not None:
                raise ValueError(f"oar.screen_tail 'linear' cannot run on this model: {why}; set oar.screen_tail to "
                                 "'probe' or 'conclude'")
            kind = "linear"
        caps = probe_capabilities(pm)
        why = ("needs a model with the prefix-cache capability; %s has none" if not caps.prefix_cache else
               "needs shared-prefix attention or a model that takes 4-D masks; %s runs attention "
               f"{caps.attn_implementation!r}" if not (caps.shared_prefix or caps.dense_mask) else None)
        if kind == "window" and why:
            if not self._warned_screen:
                _log.warning("screen 'window' " + why + ": screening with OAR-G", type(pm).__name__)
                self._warned_screen = True
            kind = "oar_g"
        t0 = time.perf_counter()
        if kind == "linear":
            screen = oar_p_linear_tail_scores(pm, pbatch, window=int(cfg.screen_window), probe=cfg.probe,
                                              rows=step.active, positions=positions,
                                              memory_budget_mb=step.memory_budget_mb, spans=step.spans)
        elif kind == "window":
            screen = oar_p_window_scores(pm, pbatch, window=int(cfg.screen_window), probe=cfg.probe,
                                         rows=step.active, positions=positions, memory_budget_mb=step.memory_budget_mb,
                                         keep_clean_pass=not screen_only, spans=step.spans,
                                         rerun_tail=cfg.screen_tail)
        else:
            screen = oar_g_scores(pm, pbatch, probe=cfg.probe, rows=step.active, sigma=cfg.sigma,
                                  noise_draws=cfg.noise_draws, generator=step.generator,
                                  memory_budget_mb=step.memory_budget_mb,
                                  positions=positions if step.spans is None else _span_positions(step.spans))
            for r, units in (step.spans or {}).items():  # the screen in unit form (method.md section 11)
                screen.scores[r] = span_sums(screen.scores[r], units)
        screen_s = time.perf_counter() - t0
        if screen_only:
            screen.stats.update(screen_fraction=0.0, screen_seconds=screen_s)
            return screen
        fraction = self._fraction(step, pbatch, positions, screen_s, screen.clean_pass is None)
        att = oar_p_screened_scores(pm, pbatch, screen, fraction=fraction, sample_fraction=cfg.screen_sample,
                                    rows=step.active, generator=step.generator, positions=positions, **kw)
        screen.clean_pass = None  # the cache is no longer needed
        if att.stats.get("tokens"):  # seconds per token the exact pass ran: the time budget's cost model
            self.exact_s_per_token = float(att.stats["seconds"]) / float(att.stats["tokens"])
        att.stats.update(forward_passes=int(screen.stats.get("forward_passes", 0)) + int(att.stats["forward_passes"]),
                         screen_fraction=fraction, screen_seconds=screen_s)
        return att

    def _fraction(self, step: Step, pbatch, positions, screen_s: float, clean_pass: bool = True) -> float:
        """The screened share of this call: ``screen_fraction``, cut (never raised) by ``screen_budget`` once a
        previous call measured both the GRPO step (:attr:`Step.outside_seconds`) and the exact pass's seconds per
        token. The exact pass of a masked reasoning token j costs the tokens from j to the end of its probe context
        (the prefix engine re-runs that suffix); the largest fraction whose cost, with the random sample's expected
        cost, fits in ``(screen_budget - 1) x GRPO step - screen seconds`` (less the exact pass's clean pass over
        every context, ``clean_pass``: False when the window screen hands over its own) is taken (0: the sample
        alone)."""
        cfg = self.config
        f_max = float(cfg.screen_fraction)
        step_s, per_tok = step.outside_seconds, self.exact_s_per_token
        if not cfg.screen_budget or step_s is None or per_tok is None or per_tok <= 0:
            return f_max
        budget_tokens = ((float(cfg.screen_budget) - 1.0) * step_s - screen_s) / per_tok
        if clean_pass:
            budget_tokens -= sum(int(pbatch.context_len[r]) for r in step.active)
        T = int(pbatch.input_ids.shape[1])
        costs = []  # per row: the suffix cost (tokens) of each candidate (left-padded: every context ends at T)
        for r in step.active:
            if step.spans is not None:
                cand = [j0 for j0, _ in step.spans.get(r, ())]
            else:
                cand = range(int(pbatch.reasoning_len[r])) if positions is None else positions.get(r, ())
            costs.append([T - int(pbatch.reasoning_start[r]) - j for j in cand])
        return budget_fraction(costs, f_max, float(cfg.screen_sample), budget_tokens)


def _span_positions(spans: dict) -> dict:
    """{row: the reasoning indices the spans cover} (the tokens an OAR-G screen perturbs and scores)."""
    return {r: [j for j0, j1 in units for j in range(j0, j1)] for r, units in spans.items()}


SPEC = MethodSpec("oar_p", RESHAPE, needs_model=True, needs_tokenizer=True, needs_answers=True, scorer=OARPScorer)
