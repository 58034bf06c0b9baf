"""The method pipeline: a :class:`oar.batch.RolloutBatch` in, per-token advantages out (method.md sections 1-9).

:class:`Pipeline` runs any method of :data:`oar.methods.METHOD_TABLE` the same way: validate the batch
(:mod:`oar.batch`), sequence advantages, then the method's credit: uniform (GRPO), reshaped importance scores
(:func:`oar.ops.reshape_advantages` of the method's scorer) or an additive bonus; then the diagnostics
(:mod:`oar.metrics`). What a method needs and how it scores lives in its module under :mod:`oar.methods`; what
knows a trainer is a thin adapter to and from a :class:`RolloutBatch` (:func:`oar.token_advantages`,
``oar.integrations.{trl,verl,openrlhf}``).

Rows are always named in the caller's indexing (row ``i`` of the batch passed in), also when rows with a zero
sequence advantage are skipped or groups are regrouped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import torch

from oar import _args
from oar.attribution import (DEFAULT_ACTION_MARKERS, DEFAULT_MARKERS, ProbeContextBuilder, as_probe_model,
                             reasoning_length)
from oar.attribution.spans import span_starts, span_sums, spans_of, token_texts
from oar.attribution.turns import (answer_log_likelihoods, reward_turn_weights, turn_runs, turn_segments,
                                  turn_weights)
from oar.batch import (Batch, RolloutBatch, TokenAdvantages, TokenScores, batch_sequence_advantages,
                       check_token_ids, validate)
from oar.distributed import ForwardGate, distributed_world
from oar.methods import UNIFORM, Step, method_spec
from oar.metrics import pipeline_metrics
from oar.schema import CREDIT_ROWS, config_arg

__all__ = ["Pipeline", "credited_rows", "scored_rows"]


# ==== the pipeline ==========================================================================================


def credited_rows(sequence_advantages: torch.Tensor, credit_rows: str) -> torch.Tensor:
    """Which rows get the method's token-level credit under ``credit_rows`` (docs/method.md section 12).

    Args:
        sequence_advantages: (B,) real, the rows' sequence advantages A_i.
        credit_rows: ``"all"`` (every row), ``"positive"`` (A_i > 0) or ``"negative"`` (A_i < 0); the other rows keep
            GRPO's uniform credit A_i x mask and are never scored.

    Returns:
        (B,) bool CPU tensor.

    Raises:
        ValueError: ``credit_rows`` not one of :data:`oar.schema.CREDIT_ROWS`.
    """
    if credit_rows not in CREDIT_ROWS:
        raise ValueError(f"credit_rows must be one of {list(CREDIT_ROWS)}, got {credit_rows!r}")
    adv = sequence_advantages.detach().reshape(-1).cpu()
    if credit_rows == "all":
        return torch.ones(adv.shape, dtype=torch.bool)
    return adv > 0 if credit_rows == "positive" else adv < 0


def scored_rows(sequence_advantages: torch.Tensor, credit_rows: str) -> list[int]:
    """The rows a :class:`Pipeline` scores (methods that do not score every row): a non-zero sequence advantage,
    of the sign ``credit_rows`` credits (:func:`credited_rows`). The trainer adapters send only these rows to the
    workers.

    Args:
        sequence_advantages: (B,) real. credit_rows: ``"all"``, ``"positive"`` or ``"negative"``.

    Returns:
        the row indices, ascending (possibly empty).

    Raises:
        ValueError: ``credit_rows`` unknown.
    """
    adv = sequence_advantages.detach().float().cpu().reshape(-1)
    keep = (adv != 0) & credited_rows(adv, credit_rows)
    return [int(i) for i in torch.nonzero(keep).reshape(-1)]


class Pipeline:
    """Runs one credit-assignment method on rollout batches (method.md sections 1-8).

    Args:
        config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q = 0.25, beta = 1, floor = 0.1).
        tokenizer: the policy's Hugging Face tokenizer: needed by the methods whose :class:`MethodSpec` says
            ``needs_tokenizer`` (reasoning span, probe contexts); KTAE uses its EOS / PAD ids as ``ignore_ids``.
        markers: final-answer markers that end the reasoning span.
        pad_id: PAD id of OAR-P's masked variants (default: the tokenizer's pad, then eos).
        sync_forwards: keep the policy forwards in step across ranks (:class:`oar.distributed.ForwardGate`;
            required under ZeRO-3 / FSDP); None = whenever torch.distributed runs with more than one process.
        ignore_ids: token ids KTAE scores 0 (default: the tokenizer's EOS and PAD ids, none without tokenizer).
        action_markers: tool-call openers that end a turn's reasoning under ``turn_probe: action`` (default
            :data:`oar.attribution.DEFAULT_ACTION_MARKERS`).

    Raises:
        ValueError: ``config`` not an ``oar.OARConfig``; a tokenizer without pad and eos ids.
    """

    def __init__(self, config=None, tokenizer=None, *, markers: Sequence[str] | None = None, pad_id: int | None = None,
                 sync_forwards: bool | None = None, ignore_ids: Sequence[int] | None = None,
                 action_markers: Sequence[str] | None = None):
        self.config = config_arg(config)
        self.method = method_spec(self.config.method)
        #: the method's scorer (built once: its state, e.g. screened OAR-P's time budget, lives with it)
        self.scorer = self.method.scorer(self.config) if self.method.scorer is not None else None
        self.tokenizer = tokenizer
        self.sync_forwards = sync_forwards
        self.builder = None
        if tokenizer is not None:
            self.builder = ProbeContextBuilder(tokenizer, self.config.conclude, self.config.answer_suffix,
                                               pad_id=pad_id, markers=markers if markers is not None else DEFAULT_MARKERS)
        self._pad_id = self.builder.pad_id if self.builder is not None else int(pad_id or 0)
        self.action_markers = tuple(DEFAULT_ACTION_MARKERS if action_markers is None else action_markers)
        if any(not isinstance(m, str) or not m for m in self.action_markers):
            raise ValueError(f"action_markers must be non-empty strings, got {list(self.action_markers)}")
        if ignore_ids is None:
            ignore_ids = self.builder.stop_ids if self.builder is not None else ()
        self.ignore_ids = _args.token_ids_arg("ignore_ids", ignore_ids)
        self._generator = torch.Generator().manual_seed(int(self.config.seed))
        self.calls = 0
        #: wall time (s) between the end of the previous call and the start of the last one: the trainer's GRPO step
        #: outside this pipeline (screened OAR-P's ``screen_budget`` reads it); None before the second call.
        self.outside_seconds: float | None = None
        self._last_end: float | None = None
        #: cap (MiB) on the config's ``memory_budget_mb``, set by a trainer adapter from what the trainer already
        #: budgets per forward (None: the config's budget); see :attr:`memory_budget_mb`.
        self.memory_budget_cap_mb: int | None = None

    @property
    def memory_budget_mb(self) -> int:
        """Activation budget (MiB) of one OAR-P / OAR-G / entropy chunk: the config's ``memory_budget_mb``, capped
        by :attr:`memory_budget_cap_mb` when an adapter set one (docs/trainers/*.md)."""
        budget = int(self.config.memory_budget_mb)
        cap = self.memory_budget_cap_mb
        return budget if cap is None else max(1, min(budget, int(cap)))

    @property
    def pad_id(self) -> int:
        """PAD id of OAR-P's masked variants and of the ForwardGate's dummy forwards."""
        return self._pad_id

    # ---- public entries ------------------------------------------------------------------------------------

    def compute(self, batch: RolloutBatch, model=None, *, preset: str | None = None) -> TokenAdvantages:
        """Token advantages of ``batch`` with this pipeline's method.

        Args:
            batch: the rollouts (:class:`oar.batch.RolloutBatch`).
            model: the policy (Hugging Face causal LM or an :class:`oar.attribution.ProbeModel`) for the methods
                that run it; parameter ``.grad`` is never written.
            preset: trainer convention of the group statistics when the advantages are computed from rewards
                (``"trl"``, ``"verl"``, ``"openrlhf"``; default: the config's ``std``/``eps``/``singleton``).

        Returns:
            :class:`oar.batch.TokenAdvantages` on the device of the batch's sequence advantages (else rewards, else
            completion ids). Reshaping methods keep each row's mass: ``advantages[b].sum() ==
            sequence_advantages[b] * eligible_mask[b].sum()`` up to float rounding.

        Raises:
            ValueError: a malformed batch (naming the field and the caller's row), a NaN reward without
                ``skip_nan`` (naming its group), a missing input of the method (naming it), token ids outside
                the model's vocabulary.
        """
        t0 = self._call_started()
        step = self._step(batch, model, preset)
        b, adv = step.b, step.adv
        tok, weights, sc, reasoning = self.method.credit.token_advantages(self, step)
        if self.method.credit is not UNIFORM and self.config.credit_rows != "all":
            # rows outside credit_rows: GRPO's uniform credit (a scores_all_rows method scored them for its tables)
            off = ~credited_rows(adv, self.config.credit_rows)
            if bool(off.any()):
                keep = ~off[:, None]
                tok = torch.where(keep, tok, (adv[:, None] * b.eligible).to(tok.dtype))
                weights = torch.where(keep, weights, b.eligible.to(weights.dtype))
                sc = torch.where(keep, sc, torch.zeros((), dtype=sc.dtype))
                reasoning = reasoning & keep
        self.calls += 1
        metrics = pipeline_metrics(tok, weights, b.eligible, reasoning, step.active, step.stats, adv, b.group_ids, t0)
        self._last_end = time.perf_counter()
        dev = b.out_device
        return TokenAdvantages(tok.to(dev), weights.to(dev), sc.to(dev), reasoning.to(dev), metrics, adv.to(dev))

    def scores(self, batch: RolloutBatch, model=None, *, preset: str | None = None) -> TokenScores:
        """Importance scores only (no reshaping), for trainers that fold advantages elsewhere.

        Rows whose sequence advantage is 0 are not scored (their token advantages are 0 whatever the scores).
        For ``grpo`` / ``dr_grpo`` the scores are all 0 and the reasoning mask empty; for the additive methods
        the scores are the bonus's inputs (entropies, KTAE token scores) on the eligible tokens.

        Returns:
            :class:`oar.batch.TokenScores` on the same device as :meth:`compute`'s outputs.

        Raises:
            ValueError: as :meth:`compute`.
        """
        self._call_started()
        step = self._step(batch, model, preset)
        step.scores_only = True
        b = step.b
        sc, reasoning = self.method.credit.scores(self, step)
        if self.config.credit_rows != "all":  # rows outside credit_rows: no token-level scores (uniform credit)
            keep = credited_rows(step.adv, self.config.credit_rows)[:, None]
            sc = torch.where(keep, sc, torch.zeros((), dtype=sc.dtype))
            reasoning = reasoning & keep
        self._last_end = time.perf_counter()
        dev = b.out_device
        turn_weights = None
        if step.turns:
            turn_weights = torch.ones((b.B, b.C), dtype=torch.float32)
            for i, turns in step.turns.items():
                for c, w in turns:
                    turn_weights[i, c] = w
            turn_weights = turn_weights.to(dev)
        return TokenScores(sc.to(dev), reasoning.to(dev), dict(step.stats), turn_weights)

    def reasoning_lengths(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                          rows: Sequence[int] | None = None) -> list[int]:
        """L_i of each completion row (right-padded completions, mask True on real tokens): the number of
        leading completion tokens before the final-answer marker (method.md section 2). With ``rows``, only those
        rows are decoded and the others get 0."""
        b = self._need_builder("reasoning_lengths")
        cmask = completion_mask.detach().bool().cpu()
        cids = completion_ids.detach().cpu()
        want = range(cids.shape[0]) if rows is None else set(rows)
        return [reasoning_length(cids[i][cmask[i]].tolist(), self.tokenizer, b.markers, b.stop_ids) if i in want
                else 0 for i in range(cids.shape[0])]

    # ---- internals -----------------------------------------------------------------------------------------

    def _call_started(self) -> float:
        """Start of a call; the wall time since the previous call ended is the last GRPO step (screen_budget)."""
        t0 = time.perf_counter()
        if self._last_end is not None:
            self.outside_seconds = t0 - self._last_end
        return t0

    def _step(self, batch: RolloutBatch, model, preset: str | None) -> Step:
        """The validated batch, its sequence advantages and the rows the method scores (caller's indexing)."""
        b = validate(batch)
        adv = batch_sequence_advantages(b, batch, self.config, preset)
        # checks credit_rows too (an attribute set after parsing is not schema-checked)
        active = scored_rows(adv, self.config.credit_rows)  # rows outside credit_rows keep uniform credit
        if self.method.scores_all_rows:
            active = list(range(b.B))
        step = Step(b, adv, active, self.config, self._generator, self.memory_budget_mb, self.ignore_ids,
                    self.outside_seconds, model_pass=None, model=model)
        step.model_pass = lambda: self._model_pass(step)
        return step

    def _need_builder(self, what: str):
        return self.method.require("tokenizer", self.builder, f"for {what}")

    @contextlib.contextmanager
    def _model_pass(self, step: Step):
        """Yields the policy as a ProbeModel, behind a ForwardGate when ranks must stay in step (raises without a
        model); finishes the gate afterwards, on every rank, also with no rows to score (a collective)."""
        self.method.require("model", step.model)
        pm = as_probe_model(step.model)
        if self.sync_forwards or (self.sync_forwards is None and distributed_world()):
            step.gate = pm = ForwardGate(pm, pad_id=self._pad_id)
        try:
            with pm.eval_mode():  # a required ProbeModel member (as_probe_model checked the model)
                yield pm
                # The dummy calls of the other ranks' remaining work run in eval mode too, as the real calls do: in
                # training mode, a policy with activation checkpointing (TRL's default gradient_checkpointing=True)
                # would recompute a dummy's layers in its backward, and under ZeRO-3 that recomputation gathers
                # parameters again: collectives no real call of a peer issues (a gloo "collective mismatch").
                if step.gate is not None:
                    step.gate.finish()
        finally:
            if step.gate is not None:
                step.gate.finish()
                step.stats["padding_forwards"] = sum(step.gate.dummy_calls.values())

    def _scores(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (B, C) and reasoning mask (B, C) of a reshaping method: the batch's own, the trainer's precomputed
        ones (entropies), or the method scorer's on the eligible reasoning tokens of the active rows. Rows of several
        turns (``turn_probe: answer``) are scored turn by turn and get ``step.turns`` (docs/method.md section 13)."""
        b = step.b
        if b.scores is not None:
            reasoning = b.reasoning & b.eligible
            step.turns = self._given_turns(b, step.adv, self._segments(b, step.active))
            return torch.where(reasoning, b.scores, torch.zeros(())), reasoning
        pre = self.scorer.precomputed(step)
        if pre is not None:  # e.g. the trainer's own entropies: no forward
            segments = self._segments(b, step.active)
            reasoning = self._reasoning_mask(b, step.active, segments)
            step.turns = self._given_turns(b, step.adv, segments)
            return torch.where(reasoning, pre, torch.zeros(())), reasoning
        builder = self._need_builder("the reasoning span and probe contexts")
        if self.config.turn_probe != "action":  # action probes read the model's own tokens, no reference
            self.method.require("answers", b.answers)
        self.method.require("prompt_ids", b.prompt_ids)
        sc = torch.zeros((b.B, b.C), dtype=torch.float32)
        reasoning = torch.zeros((b.B, b.C), dtype=torch.bool)
        pm_ctx = self._model_pass(step) if self.method.needs_model else contextlib.nullcontext(None)
        with pm_ctx as pm:
            if not step.active:
                return sc, reasoning
            vocab = int(pm.vocab_size) if pm is not None else 0
            prompts = (check_token_ids(b.cids, b.cmask, b.prompt_ids, step.active, vocab) if b.prompt_ids is not None
                       else [torch.zeros(0, dtype=torch.long)] * b.B)
            segments = self._segments(b, step.active)
            if segments is None:  # no row of several turns: engine row r is the caller's row r
                pbatch, cols = self._probe_batch(b, step.active, prompts, builder)
                keys, src, run = step.active, {i: i for i in step.active}, step
            else:  # one engine row per turn (docs/method.md section 13)
                pbatch, cols, src = self._turn_batch(b, segments, prompts, builder)
                keys = list(range(len(src)))
                run = dataclasses.replace(step, active=keys, spans=None)
            positions = self._eligible_positions(b, keys, src, cols, pbatch)
            run.spans = self._spans(b, keys, src, cols, pbatch, positions)
            att = self.scorer.score(run, pm, pbatch, positions)
            if segments is not None:
                step.turns = self._turns(step, pm, b, segments, prompts, pbatch, src, builder)
        step.stats.update({k: v for k, v in att.stats.items() if k != "padding_forwards"})
        if step.stats.get("turn_probe_forwards"):
            step.stats["forward_passes"] = int(step.stats.get("forward_passes", 0)) + step.stats["turn_probe_forwards"]
        if run.spans is not None and not self.scorer.masks_spans:
            for k, units in run.spans.items():  # the unit rule for token-level scorers (method.md section 11)
                att.scores[k] = span_sums(att.scores[k], units)
        for k in keys:
            L = int(pbatch.reasoning_len[k])
            sc[src[k], cols[k][:L]] = att.scores[k, :L]
            reasoning[src[k], cols[k][:L]] = True
        reasoning &= b.eligible
        return torch.where(reasoning, sc, torch.zeros(())), reasoning

    def _probe_batch(self, b: Batch, active: list[int], prompts: list[torch.Tensor], builder):
        """Probe contexts of all B rows (rows not scored get a stub: empty prompt and response, so that engine
        row r is the caller's row r) and each row's completion columns (reasoning token j = column cols[i][j])."""
        cols = [torch.nonzero(b.cmask[i]).flatten() for i in range(b.B)]
        responses = [b.cids[i][b.cmask[i]] for i in range(b.B)]
        lens = self.reasoning_lengths(b.cids, b.cmask, active)  # decode the scored rows only
        on = set(active)
        answers = b.answers if b.answers is not None else ["0"] * b.B  # random / entropy never read the answer
        ps, rs, ans, ls = [], [], [], []
        for i in range(b.B):
            if i in on:
                ps.append(prompts[i]), rs.append(responses[i]), ans.append(str(answers[i])), ls.append(lens[i])
            else:
                ps.append([]), rs.append([]), ans.append("0"), ls.append(0)
        return builder.build(ps, rs, ans, ls), cols

    def _segments(self, b: Batch, active: list[int]) -> dict | None:
        """{row: [(s, e), ...]} the turn ranges (completion indices, :func:`oar.attribution.turns.turn_segments`)
        of the active rows when ``turn_probe`` is ``answer`` and some row has two turns or more, or ``action`` (every
        row is then probed on its own action); else None."""
        if self.config.turn_probe == "session":
            return None
        out = {i: turn_segments(b.eligible[i][b.cmask[i]]) for i in active}
        return out if self.config.turn_probe == "action" or any(len(v) > 1 for v in out.values()) else None

    def _turn_markers(self, builder) -> tuple:
        """The markers that end a turn's reasoning span: the final-answer markers, and the tool-call openers under
        ``turn_probe: action``."""
        return builder.markers + (self.action_markers if self.config.turn_probe == "action" else ())

    def _turn_batch(self, b: Batch, segments: dict, prompts: list[torch.Tensor], builder):
        """Probe contexts of one engine row per turn of the active rows: the prompt and the completion before the
        turn as prompt, the turn as response (its reasoning span found in the turn alone), the row's answer or, under
        ``turn_probe: action``, the turn's own action. Returns (ProbeBatch, each engine row's completion columns, each
        engine row's caller row)."""
        answers = b.answers if b.answers is not None else ["0"] * b.B
        markers = self._turn_markers(builder)
        ps, rs, ans, ls, cols, src = [], [], [], [], [], []
        for i, segs in segments.items():
            c = torch.nonzero(b.cmask[i]).flatten()
            ids = b.cids[i, c]
            for s, e in segs:
                resp = ids[s:e]
                ps.append(torch.cat([prompts[i], ids[:s]])), rs.append(resp), ans.append(str(answers[i]))
                ls.append(reasoning_length(resp.tolist(), self.tokenizer, markers, builder.stop_ids))
                cols.append(c[s:e]), src.append(i)
        if self.config.turn_probe == "action":
            return builder.build_actions(ps, rs, ls), cols, src
        return builder.build(ps, rs, ans, ls), cols, src

    def _turns(self, step: Step, pm, b: Batch, segments: dict, prompts, pbatch, src: list, builder) -> dict:
        """{row: [(turn columns, weight), ...]} of the rows of several turns: weights 1 (``turn_credit: uniform``) or
        from the answer probe's log-likelihood before turn 1, after each turn's observation and at the end of the
        last turn's reasoning (``probe``: :func:`oar.attribution.turns.turn_weights`; K + 1 clean probes a row)."""
        multi = {i: segs for i, segs in segments.items() if len(segs) > 1}
        last = {src[k]: int(pbatch.reasoning_len[k]) for k in range(len(src))}  # the last turn's L wins
        out, counts = {}, {}
        for i, segs in multi.items():
            c = torch.nonzero(b.cmask[i]).flatten()
            out[i] = [c[s:e] for s, e in segs]
            counts[i] = torch.tensor([int(b.eligible[i, c[s:e]].sum()) for s, e in segs])
        if self.config.turn_credit == "rewards":  # weights 1 where only scores leave (the driver has the rewards)
            if step.scores_only and b.turn_rewards is None:
                return {i: [(cc, 1.0) for cc in out[i]] for i in out}
            return {i: self._reward_turns(b, step.adv, i, out[i]) for i in out}
        if self.config.turn_credit != "probe":
            return {i: [(cc, 1.0) for cc in out[i]] for i in out}
        answers = b.answers
        if answers is None:
            raise ValueError(f"turn_credit 'probe' probes the reference answer across each turn, but the batch has no "
                             f"answers (method {self.method.name!r}): pass RolloutBatch.answers, or set turn_credit to "
                             "'uniform'")
        pr, pre, ans, owner = [], [], [], []
        for i, segs in multi.items():
            ids = b.cids[i][b.cmask[i]]
            runs = turn_runs(b.eligible[i][b.cmask[i]])
            points = [runs[0][0]] + [a for a, _ in runs[1:]] + [segs[-1][0] + last[i]]
            for p in points:
                pr.append(prompts[i]), pre.append(ids[:p]), ans.append(str(answers[i])), owner.append(i)
        if pm is None:  # a method that runs no model (random, entropy with given entropies): the probes do
            if step.model is None:
                raise ValueError(f"turn_credit 'probe' runs the policy's answer probe, but method {self.method.name!r} "
                                 "was given no model: pass model=, or set turn_credit to 'uniform'")
            with self._model_pass(step) as own:
                ll, forwards = answer_log_likelihoods(own, builder, pr, pre, ans, step.memory_budget_mb)
        else:
            ll, forwards = answer_log_likelihoods(pm, builder, pr, pre, ans, step.memory_budget_mb)
        step.stats["turn_probe_forwards"] = forwards  # added to forward_passes after the scorer's counters
        res, at = {}, 0
        for i in multi:
            K = len(out[i])
            w = turn_weights(ll[at + 1: at + K + 1] - ll[at: at + K], counts[i], float(self.config.reshape.floor))
            res[i] = [(cc, float(wk)) for cc, wk in zip(out[i], w.tolist())]
            at += K + 1
        return res

    def _given_turns(self, b: Batch, adv: torch.Tensor, segments: dict | None) -> dict | None:
        """``step.turns`` of a batch that brings its scores (the trainer's workers, entropies): the turns from the
        masks (``segments``, :meth:`_segments`), their weights from the batch's ``turn_weights`` (1 without it) or,
        under ``turn_credit: rewards``, from its ``turn_rewards``; None when no row has two turns."""
        if segments is None:
            return None
        if self.config.turn_credit == "rewards":  # the rewards are the driver's: no weights from the workers
            return {i: self._reward_turns(b, adv, i, [torch.nonzero(b.cmask[i]).flatten()[s:e] for s, e in segs])
                    for i, segs in segments.items() if len(segs) > 1}
        if b.turn_weights is None and self.config.turn_credit == "probe":
            raise ValueError("turn_credit 'probe' with scores computed elsewhere needs the batch's turn_weights "
                             "(TokenScores.turn_weights of the pipeline that scored the rows, which oar's verl and "
                             "OpenRLHF workers send back; oar.integrations.verl.attach_scores takes them)")
        out = {}
        for i, segs in segments.items():
            if len(segs) > 1:
                c = torch.nonzero(b.cmask[i]).flatten()
                out[i] = [(c[s:e], 1.0 if b.turn_weights is None else float(b.turn_weights[i, c[s]])) for s, e in segs]
        return out

    def _reward_turns(self, b: Batch, adv: torch.Tensor, i: int, cols: list) -> list:
        """[(turn columns, weight), ...] of row ``i`` under ``turn_credit: rewards``
        (:func:`oar.attribution.turns.reward_turn_weights` of the row's ``turn_rewards`` and advantage sign)."""
        if b.turn_rewards is None:
            raise ValueError(f"turn_credit 'rewards' needs the batch's per-turn rewards (RolloutBatch.turn_rewards; "
                             f"verl: non_tensor_batch['tool_rewards']; TRL: a rollout_func field 'turn_rewards'), "
                             f"got none for a batch whose row {i} has "
                             f"{len(cols)} turns: pass them, or set turn_credit to 'uniform' or 'probe'")
        counts = torch.tensor([int(b.eligible[i, c].sum()) for c in cols])
        try:
            w = reward_turn_weights(b.turn_rewards[i], counts, float(torch.sign(adv[i])),
                                    float(self.config.reshape.floor))
        except ValueError as e:
            raise ValueError(f"turn_rewards[{i}]: {e} (row {i} has {len(cols)} turns, the runs of eligible_mask; "
                             "verl's tool_rewards holds one value per tool call that returned a reward: sum a turn's "
                             "calls and pass RolloutBatch.turn_rewards)") from None
        return [(c, float(wk)) for c, wk in zip(cols, w.tolist())]

    @staticmethod
    def _eligible_positions(b: Batch, keys: list[int], src, cols, pbatch) -> dict | None:
        """{engine row: eligible reasoning indices} when some reasoning token is not eligible (tool outputs), else
        None: the engines then never mask, perturb or score the others."""
        out, restricted = {}, False
        for k in keys:
            L = int(pbatch.reasoning_len[k])
            ok = b.eligible[src[k], cols[k][:L]]
            restricted |= not bool(ok.all())
            out[k] = torch.nonzero(ok).flatten().tolist()
        return out if restricted else None

    def _spans(self, b: Batch, keys: list[int], src, cols, pbatch, positions) -> dict | None:
        """{engine row: [(j0, j1), ...]} masking units of the scored rows (docs/method.md section 11): from the
        batch's ``span_starts`` when given, else from the decoded reasoning tokens by the config's ``mask_unit``; cut
        at tokens that are not eligible. None for token units without ``span_starts``."""
        unit = self.config.mask_unit
        if unit == "token" and b.span_starts is None:
            return None
        out = {}
        for k in keys:
            L = int(pbatch.reasoning_len[k])
            if L == 0:
                continue
            i, c = src[k], cols[k][:L]
            starts = (b.span_starts[i, c] if b.span_starts is not None
                      else span_starts(token_texts(self.tokenizer, b.cids[i, c]), unit))
            units = spans_of(starts, None if positions is None else positions[k])
            if units:
                out[k] = units
        return out

    def _reasoning_mask(self, b: Batch, active: list[int], segments: dict | None) -> torch.Tensor:
        """(B, C) bool: the reasoning span of each active row (of each of its turns, ``segments`` of
        :meth:`_segments`; docs/method.md section 13)."""
        reasoning = torch.zeros((b.B, b.C), dtype=torch.bool)
        if segments is None:
            lens = self.reasoning_lengths(b.cids, b.cmask, active)
            for i in active:
                reasoning[i, torch.nonzero(b.cmask[i]).flatten()[: lens[i]]] = True
            return reasoning & b.eligible
        builder = self._need_builder("the reasoning span")
        markers = self._turn_markers(builder)
        for i, segs in segments.items():
            c = torch.nonzero(b.cmask[i]).flatten()
            for s, e in segs:
                L = reasoning_length(b.cids[i, c[s:e]].tolist(), self.tokenizer, markers, builder.stop_ids)
                reasoning[i, c[s:s + L]] = True
        return reasoning & b.eligible
