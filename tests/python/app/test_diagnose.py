"""``oar diagnose`` (oar.app.diagnose, oar.app.diagnose_core) on a tiny random model with planted rewards.

References are independent of the code under test: the exact policy gradient of expected reward by enumeration
(one-token completions), per-row autograd of the surrogate, published Student-t quantiles, exact sign-flip
enumeration by hand, and synthetic vectors of known signal-to-noise ratio.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import oar  # noqa: E402
from oar.app import diagnose_core as core  # noqa: E402
from oar.app.stats import paired_t, sign_flip_pvalue, t_quantile  # noqa: E402

from _paths import DOCS  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from oar.testing import tiny_random_llama

    torch.set_num_threads(1)
    return tiny_random_llama(tokenizer="minimal", hidden_size=32, num_layers=2, num_heads=2, seed=0,
                             initializer_range=0.3)


def _prompts(n, offset=0):
    return [[5 + ((i + offset) % 40), 7 + ((i + offset) * 3) % 50, 9] for i in range(n)]


def _first_token_even(i, ids, text):  # planted: only the first completion token decides the reward
    return float(len(ids) > 0 and ids[0] % 2 == 0)


def _sample(model, tok, prompts, group, seed, new=6):
    return core.sample_rollouts(model, prompts, _first_token_even, group_size=group, temperature=1.0,
                                max_new_tokens=new, seed=seed, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                answers=["4"] * len(prompts))


# ---- statistics ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("df,q", [(1, 12.7062), (5, 2.5706), (30, 2.0423), (1e7, 1.9600)])
def test_t_quantile_matches_published_tables(df, q):
    assert t_quantile(0.975, df) == pytest.approx(q, abs=6e-5)  # the tables' 4 decimals
    assert t_quantile(0.025, df) == pytest.approx(-q, abs=6e-5)


def test_paired_t_and_sign_flip_by_hand():
    d = [1.0, 2.0, 3.0, 4.0]
    iv = paired_t(d)
    se = np.std(d, ddof=1) / 2
    assert iv.mean == 2.5 and iv.hi - iv.mean == pytest.approx(3.1824 * se, rel=1e-4)  # t_{0.975, 3} = 3.1824
    # of the 16 sign patterns only all-plus and all-minus reach |mean| = 2.5
    assert sign_flip_pvalue(d) == pytest.approx(2 / 16)
    assert sign_flip_pvalue([1.0, -1.0, 1.0, -1.0]) == 1.0
    with pytest.raises(ValueError, match="diffs must be 1-D with >= 2"):
        paired_t([1.0])


# ---- specs -----------------------------------------------------------------------------------------------------

def test_jackknife_se_of_a_mean_is_the_standard_error():
    from oar.app.stats import jackknife_se

    x = np.array([0.3, -1.2, 2.5, 0.7, 1.1])
    loo = np.array([np.delete(x, i).mean() for i in range(x.size)])
    assert jackknife_se(loo) == pytest.approx(x.std(ddof=1) / np.sqrt(x.size), rel=1e-12)


def test_t_with_reference_covers_when_the_reference_is_noisy():
    """Monte Carlo coverage: N units with noise sd 1 around a reference-dependent mean whose own error (sd 0.5) comes
    from F folds. The batches-only t interval undercovers; the two-source interval covers about 95%."""
    from oar.app.stats import t_with_reference

    rng = np.random.default_rng(0)
    N, F, sims, truth = 12, 4, 2000, 0.0
    hit_two, hit_units = 0, 0
    for _ in range(sims):
        folds = rng.normal(0.0, 0.5 * np.sqrt(F), F)  # the reference's error: the mean of F folds, sd 0.5
        units = truth + folds.mean() + rng.normal(0.0, 1.0, N)
        loo = np.array([units.mean() - folds.mean() + np.delete(folds, c).mean() for c in range(F)])
        iv = t_with_reference(units, loo)
        hit_two += iv.lo <= truth <= iv.hi
        hit_units += paired_t(units).lo <= truth <= paired_t(units).hi
    # binomial sd of a 95% coverage over 2000 draws: 0.005; Welch's df is approximate, so allow 3 points
    assert 0.92 <= hit_two / sims <= 0.98
    assert hit_units / sims < 0.90  # the reference's noise is real: ignoring it undercovers
    iv = t_with_reference([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])  # no reference noise: the plain t interval
    ref = paired_t([1.0, 2.0, 3.0])
    assert (iv.lo, iv.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-9)


def test_break_even_dcos_matches_averaged_noise():
    """Against a direct simulation of the model it states: averaging k = 1 + c noisy updates raises the cosine with
    the signal by the break-even amount (first order); about cos x c / 2 for small SNR and c."""
    from oar.app.stats import break_even_dcos

    rng = np.random.default_rng(1)
    D, snr, c = 20000, 0.05, 1.0
    mu = rng.normal(size=D)
    mu *= 1.0 / np.linalg.norm(mu)
    sigma = np.sqrt(1.0 / snr / D)  # E|noise|^2 = D sigma^2 = 1 / snr = |mu|^2 / snr

    def cos(k):
        u = mu + rng.normal(0.0, sigma / np.sqrt(k), D)
        return float(u @ mu / np.linalg.norm(u))

    c1 = np.mean([cos(1) for _ in range(50)])
    c2 = np.mean([cos(1 + c) for _ in range(50)])
    # the simulated gain, and the formula's, both from the simulated cos at k = 1; D = 20000 makes the
    # norm's fluctuation ~ 1 / sqrt(D): the two agree to a few percent of the gain
    assert c2 - c1 == pytest.approx(break_even_dcos(c1, snr, c), rel=0.05)
    assert break_even_dcos(0.165, 0.0, 0.12) == pytest.approx(0.165 * (np.sqrt(1.12) - 1), rel=1e-12)
    assert break_even_dcos(0.165, 0.046, 0.0) == 0.0
    with pytest.raises(ValueError, match="must be >= 0"):
        break_even_dcos(0.1, 0.05, -1.0)


def test_parse_credit():
    s = core.parse_credit("oar_g:beta=2, q=0.5,credit_rows=positive")
    assert (s.method, dict(s.overrides), s.credit_rows) == ("oar_g", {"beta": 2, "q": 0.5}, "positive")
    assert core.parse_credit("entropy_top:quantile=0.2").quantile == 0.2
    for bad, msg in [("nope", "unknown method 'nope'"), ("oar_g:beta", "expected key=value"),
                     ("oar_g:credit_rows=up", "credit_rows must be one of"),
                     ("oar_g:sign=positive", "sign= is now credit_rows="),
                     ("oar_g:q=1,q=2", "key 'q' given twice"), ("oar_g:", "expected key=value"),
                     ("oar_g:quantile=0.2", "quantile is a key of entropy_top"),
                     ("entropy_top:quantile=0", r"quantile must be in \(0, 1\]"), ("", "non-empty")]:
        with pytest.raises(ValueError, match=msg):
            core.parse_credit(bad)


@pytest.mark.parametrize("spec", ["oar_g", "oar_g:credit_rows=positive", "oar_p:q=0.5, beta=2",
                                  "oar_g:credit_rows=negative,beta=0"])
def test_compare_and_diagnose_read_a_setting_alike(spec):
    """One parser (oar.schema.parse_method_spec) and one name (credit_rows) for both tools."""
    from oar.app.compare import parse_method

    name, overrides = parse_method(spec)
    c = core.parse_credit(spec)
    from oar.schema import yaml_load
    keys = {o.split("=", 1)[0][len("oar."):]: yaml_load(o.split("=", 1)[1], "v") for o in overrides}
    assert c.method == name
    assert {**dict(c.overrides), "credit_rows": c.credit_rows} == {"credit_rows": "all", **keys}
    cfg = core.config_for(oar.OARConfig(), c, seed=0)
    assert cfg.credit_rows == keys.get("credit_rows", "all")


def test_credit_rows_shares_the_rows_noise(tiny):
    """oar_g:credit_rows=positive = oar_g's advantages on the rows with A > 0 and GRPO's uniform ones elsewhere,
    exactly: the pipeline scores only those rows, and OAR-G's noise of a row is a function of (seed, row), not of
    which rows are scored (common random numbers across settings)."""
    model, tok = tiny
    r = _sample(model, tok, _prompts(4), 4, seed=2)
    kw = dict(model=model, tokenizer=tok, base_config=oar.OARConfig(), seed=17)
    full, seq, _ = core.method_advantages(core.parse_credit("oar_g"), r, **kw)
    pos, seq2, _ = core.method_advantages(core.parse_credit("oar_g:credit_rows=positive"), r, **kw)
    grpo, _, _ = core.method_advantages(core.parse_credit("grpo"), r, **kw)
    assert torch.equal(seq, seq2)
    up, down = seq > 0, seq < 0
    assert up.any() and down.any(), "the sample needs rows of both signs"
    assert not torch.allclose(full[up], grpo[up]), "OAR-G credit must differ from uniform: else the test is vacuous"
    # the same noise on the same row: equal up to float32 rounding of a different chunk (other rows padded in)
    torch.testing.assert_close(pos[up], full[up], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(pos[down], grpo[down], rtol=0, atol=0)


def test_bad_override_names_the_spec(tiny):
    model, tok = tiny
    r = _sample(model, tok, _prompts(2), 2, seed=0)
    with pytest.raises(ValueError, match="method spec 'oar_g:nonsense=1'"):
        core.method_advantages(core.parse_credit("oar_g:nonsense=1"), r, model=model, tokenizer=tok,
                               base_config=oar.OARConfig(), seed=0)


# ---- the computations ------------------------------------------------------------------------------------------

def test_reference_gradient_matches_exact_gradient(tiny):
    """One-token completions: grad E[R] = grad sum_y pi(y|x) R(y) by enumeration, against the sampled estimate."""
    model, tok = tiny
    params = list(model.parameters())
    prompts = _prompts(4)
    # exact: sum over the vocabulary of softmax(first-token logits) * R, averaged over prompts
    ids = torch.tensor(prompts)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
    R = torch.tensor([float(v % 2 == 0) for v in range(logits.shape[-1])])
    exact = torch.autograd.grad((torch.softmax(logits, -1) @ R).mean(), params)
    r = _sample(model, tok, prompts, group=2048, seed=3, new=1)
    est = core.reference_gradient(model, r, params, tok.pad_token_id, micro_batch=4096)
    cos = core.grad_dot(est, exact) / (core.grad_norm(est) * core.grad_norm(exact))
    # 8192 rollouts: the estimate's relative error is about 1 / sqrt(8192 * p(1 - p)) in norm: cos > 0.95 by far
    assert cos > 0.95
    assert core.grad_norm(est) == pytest.approx(core.grad_norm(exact), rel=0.15)
    with pytest.raises(ValueError, match=">= 2 rollouts per prompt"):
        core.reference_gradient(model, _sample(model, tok, prompts, 1, seed=0), params, tok.pad_token_id)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_token_logprobs_are_trls_at_the_sampling_temperature(tiny, temperature):
    """At T != 1 the rollouts come from softmax(logits / T): token_logprobs (hence u and g_ref) and the entropies
    equal TRL's own ``_get_per_token_logps_and_entropies`` (logits divided by ``temperature``) on the same ids."""
    import inspect
    from types import SimpleNamespace

    trl = pytest.importorskip("trl")
    model, tok = tiny
    prompts = _prompts(3)  # equal lengths: TRL passes no position_ids, so no left padding keeps positions equal
    r = core.sample_rollouts(model, prompts, _first_token_even, group_size=2, temperature=temperature,
                             max_new_tokens=6, seed=5, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    assert r.temperature == temperature
    rows = list(range(r.batch_size))
    with torch.no_grad():
        lp, ent = core.token_logprobs(model, r, rows, tok.pad_token_id, with_entropy=True)
        ids = torch.cat([torch.stack(r.prompt_ids), torch.where(r.completion_mask, r.completion_ids,
                                                                tok.pad_token_id)], 1)
        att = torch.cat([torch.ones(r.batch_size, len(prompts[0]), dtype=torch.long), r.completion_mask.long()], 1)
        host = SimpleNamespace(temperature=temperature, _entropy_bonus_enabled=False,
                               model_kwarg_keys=set(inspect.signature(model.forward).parameters))
        fn = trl.GRPOTrainer._get_per_token_logps_and_entropies
        ref_lp, ref_ent, _ = getattr(fn, "__wrapped__", fn)(host, model, ids, att, r.completion_ids.shape[1],
                                                             compute_entropy=True)
    m = r.completion_mask
    assert m.sum() > 6
    # the same float32 forward and log-softmax: differences are rounding (|log p| <= ~10 here)
    torch.testing.assert_close(lp[m], ref_lp[m].float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m].float(), rtol=0, atol=1e-5)
    # and the temperature matters: at T = 1 the log-probs differ by far more than that
    r1 = core.Rollouts(r.prompt_ids, r.completion_ids, r.completion_mask, r.rewards, r.group_size)
    with torch.no_grad():
        lp1 = core.token_logprobs(model, r1, rows, tok.pad_token_id)
    assert (lp1[m] - lp[m]).abs().max() > 1e-2


def test_update_directions_equal_per_row_autograd(tiny):
    model, tok = tiny
    params = list(model.parameters())
    r = _sample(model, tok, _prompts(3), 4, seed=1)
    g = torch.Generator().manual_seed(0)
    advs = {"a": torch.randn(r.completion_ids.shape, generator=g) * r.completion_mask,
            "b": torch.randn(r.completion_ids.shape, generator=g) * r.completion_mask}
    whole = core.update_directions(model, r, advs, params, tok.pad_token_id)
    micro = core.update_directions(model, r, advs, params, tok.pad_token_id, micro_batch=5)
    n_tok = float(r.completion_mask.sum())
    for lab, A in advs.items():
        # independent reference: each row alone, unpadded, its own forward
        ref = [torch.zeros_like(p) for p in params]
        for i in range(r.batch_size):
            L = int(r.completion_mask[i].sum())
            seq = torch.cat([r.prompt_ids[i], r.completion_ids[i, :L]])[None]
            P = r.prompt_ids[i].numel()
            lp = torch.log_softmax(model(input_ids=seq).logits[0, P - 1:P - 1 + L].float(), -1)
            obj = (A[i, :L] * lp.gather(-1, r.completion_ids[i, :L, None]).squeeze(-1)).sum() / n_tok
            for acc, x in zip(ref, torch.autograd.grad(obj, params, allow_unused=True)):
                if x is not None:
                    acc += x
        for got in (whole[lab], micro[lab]):
            for x, y in zip(got, ref):
                # float32 forward of a 2-layer model: differences are rounding, far below 1e-5 of the scale
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6 * max(1.0, core.grad_norm(ref)))


def test_uniform_weights_equal_grpo_exactly(tiny):
    """A setting whose weights are exactly uniform (beta = 0, floor = 1; the top-100% entropy selection) gives grpo's
    token advantages and therefore grpo's update, bit for bit."""
    model, tok = tiny
    r = _sample(model, tok, _prompts(4), 4, seed=2)
    _, ent = core.token_logprobs(model, r, list(range(r.batch_size)), tok.pad_token_id, with_entropy=True)
    kw = dict(model=model, tokenizer=tok, base_config=oar.OARConfig(), seed=0, entropies=ent)
    grpo, seq, _ = core.method_advantages(core.parse_credit("grpo"), r, **kw)
    assert bool((seq != 0).any())
    for spec in ("oar_g:beta=0,tiers=boost", "entropy_top:quantile=1", "random:beta=0,tiers=boost"):
        adv, _, _ = core.method_advantages(core.parse_credit(spec), r, **kw)
        assert torch.equal(adv, grpo), spec
    # credit_rows=positive keeps grpo's credit on the negative rows, the method's on the positive rows
    pos, _, _ = core.method_advantages(core.parse_credit("random:credit_rows=positive"), r, **kw)
    rnd, _, _ = core.method_advantages(core.parse_credit("random"), r, **kw)
    neg = seq < 0
    assert torch.equal(pos[neg], grpo[neg]) and torch.equal(pos[~neg], rnd[~neg])


def test_entropy_top_keeps_the_top_quantile(tiny):
    model, tok = tiny
    r = _sample(model, tok, _prompts(4), 4, seed=4)
    _, ent = core.token_logprobs(model, r, list(range(r.batch_size)), tok.pad_token_id, with_entropy=True)
    adv, seq, _ = core.method_advantages(core.parse_credit("entropy_top:quantile=0.25"), r, model=model,
                                         tokenizer=tok, base_config=oar.OARConfig(), seed=0, entropies=ent)
    thr = np.quantile(ent[r.completion_mask].numpy(), 0.75)  # numpy's quantile: the independent reference
    expect = r.completion_mask & (ent >= torch.tensor(thr, dtype=ent.dtype))
    active = seq != 0
    assert bool(active.any())
    assert torch.equal((adv != 0)[active], expect[active])
    assert torch.equal(adv[expect], seq[:, None].expand_as(adv)[expect])


def _exact_first_token_gradient(model, prompts, params):
    """grad E[R] of the planted reward by enumeration of the first token (the later tokens do not change R)."""
    ids = torch.tensor(prompts)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
    R = torch.tensor([float(v % 2 == 0) for v in range(logits.shape[-1])])
    return list(torch.autograd.grad((torch.softmax(logits, -1) @ R).mean(), params))


def test_planted_credit_is_ranked_right(tiny):
    """Reward decided by the first completion token alone: credit on that token aligns better with the true
    gradient (exact, by enumeration) than uniform credit, whose other tokens' terms are zero-mean noise; credit on
    every other token has expectation 0. Paired over the same 24 batches of 32 prompts x 4 rollouts (measured here:
    difference +0.18, t interval [+0.12, +0.24], about 6 standard errors from 0)."""
    model, tok = tiny
    params = list(model.parameters())
    prompts = _prompts(32 * 24)
    g = _exact_first_token_gradient(model, prompts, params)
    gn = core.grad_norm(g)

    def oracle(r, seq, ent):
        a = torch.zeros(r.completion_ids.shape)
        a[:, 0] = seq * r.completion_mask.sum(1)  # the row's whole mass on its first token
        return a

    def anti(r, seq, ent):
        a = seq[:, None] * r.completion_mask.float()
        a[:, 0] = 0
        return a

    specs = [core.parse_credit("grpo"), core.CreditSpec("oracle", "grpo", credit=oracle),
             core.CreditSpec("anti", "grpo", credit=anti)]
    cos = {s.label: [] for s in specs}
    for b in range(24):
        r = _sample(model, tok, prompts[32 * b:32 * (b + 1)], 4, seed=b, new=12)
        advs = {s.label: core.method_advantages(s, r, model=model, tokenizer=tok, base_config=oar.OARConfig(),
                                                seed=b)[0] for s in specs}
        for lab, u in core.update_directions(model, r, advs, params, tok.pad_token_id).items():
            cos[lab].append(core.grad_dot(u, g) / (core.grad_norm(u) * gn))
    d = paired_t(np.array(cos["oracle"]) - np.array(cos["grpo"]))
    assert d.lo > 0, (d, {k: np.mean(v) for k, v in cos.items()})
    assert abs(np.mean(cos["anti"])) < 0.25 * np.mean(cos["oracle"])


def test_stored_runs_of_version_1_cannot_be_recomputed():
    from oar.app.diagnose_report import summarize_stored

    root = str(DOCS / "diagnose" / "full24")
    with pytest.raises(ValueError, match="has no 'gram': written before version 2"):
        summarize_stored(root)


def test_count_sketch_inner_products_and_snr():
    g = torch.Generator().manual_seed(0)
    numels = [1000, 37, 4000]
    u = [torch.randn(n, generator=g) for n in numels]
    v = [x + 0.5 * torch.randn(x.shape, generator=g) for x in u]
    exact = core.grad_dot(u, v)
    ests = [float(core.CountSketch(numels, 256, seed=s)(u) @ core.CountSketch(numels, 256, seed=s)(v))
            for s in range(200)]
    # unbiased: the mean of 200 sketches is within 4 standard errors of the exact inner product
    assert abs(np.mean(ests) - exact) < 4 * np.std(ests) / np.sqrt(200)
    sk = core.CountSketch(numels, 64, seed=1)
    assert torch.equal(sk(u), sk(u))
    with pytest.raises(ValueError, match="gradient 1 has 36 elements, expected 37"):
        sk([u[0], u[1][:36], u[2]])
    # synthetic updates u_b = mu + noise: SNR = |mu|^2 / E|noise|^2 = 2000 / (5037 * 4) ~ 0.0993
    from oar.app.diagnose_report import snr_from_sketches

    D = 5037
    mu = torch.zeros(D)
    mu[:2000] = 1.0
    ups = [mu + 2.0 * torch.randn(D, generator=g) for _ in range(64)]
    full = core.CountSketch([D], 4096, seed=3)
    S = np.stack([full([x]).numpy() for x in ups])
    sq = np.array([float(x @ x) for x in ups])
    snr, _ = snr_from_sketches(S, sq)
    assert snr == pytest.approx(2000 / (D * 4), rel=0.25)
    # the Gram form is the same estimate: the off-diagonal sum is |sum S_b|^2 - sum |S_b|^2
    from oar.app.diagnose_report import snr_from_gram
    S64 = S.astype(np.float64)
    tot = S64.sum(0)
    cross = (tot @ tot - (S64 * S64).sum()) / (64 * 63)
    assert snr_from_gram(S64 @ S64.T, sq)[0] == pytest.approx(cross / (sq.mean() - cross), rel=1e-9)


# ---- the command -----------------------------------------------------------------------------------------------

class _PlantedSource:
    """A TaskSource stand-in: integer problems, the planted first-token reward."""

    def __init__(self, tok):
        self.tok = tok
        self.train = list(range(64))
        self.heldout = list(range(1000, 1064))

    def rollouts(self, model, problems, *, group, temperature, max_new_tokens, seed):
        return core.sample_rollouts(model, [[5 + p % 40, 7 + (p * 3) % 50, 9] for p in problems], _first_token_even,
                                    group_size=group, temperature=temperature, max_new_tokens=max_new_tokens,
                                    seed=seed, pad_id=self.tok.pad_token_id, eos_id=self.tok.eos_token_id,
                                    answers=["4"] * len(problems))


def _untimed(rows) -> str:
    """The report's rows without the wall-time fields (a recomputed batch takes other seconds)."""
    timed = ("attribution_seconds", "cost_ratio", "break_even_dcos")
    return json.dumps([{k: v for k, v in r.items() if k not in timed} for r in rows], sort_keys=True)


def test_run_resumes_and_reports(tiny, tmp_path):
    from oar.app.diagnose import DiagnoseSettings, run

    model, tok = tiny
    s = DiagnoseSettings(methods=["grpo", "random", "random:beta=0,tiers=boost"], batches=3, prompts=2, group=4,
                         ref_prompts=8, ref_group=4, max_new_tokens=5, temperature=1.0, sketch_dim=512,
                         reward_batches=1, reward_prompts=4, reward_samples=2, step_norm=0.5)
    out = str(tmp_path / "d")
    first = run(model, tok, _PlantedSource(tok), s, out, progress=False)
    def report():  # wall times (the "Batches:" and "cost / step:" lines, the cost columns) change on a rerun
        import csv as _csv

        md, drop = [], None
        for ln in open(os.path.join(out, "diagnose.md")).read().splitlines():
            if ln.startswith(("Batches:", "cost / step:")):
                continue
            cells = ln.split("|")
            if any(c.strip() == "cost / step" for c in cells):
                drop = {i for i, c in enumerate(cells) if c.strip() in ("cost / step", "break-even Δcos")}
            if drop and ln.startswith("|"):
                cells = [c for i, c in enumerate(cells) if i not in drop]
            md.append("|".join(cells))
        with open(os.path.join(out, "diagnose.csv")) as f:
            rows_csv = [{k: v for k, v in r.items() if k not in ("cost_ratio", "break_even_dcos")}
                        for r in _csv.DictReader(f)]
        return md, rows_csv

    before = report()
    rows = {r["method"]: r for r in first["rows"]}
    assert rows["random:beta=0,tiers=boost"]["dcos"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert rows["random:beta=0,tiers=boost"]["cos"] == rows["grpo"]["cos"]
    assert rows["grpo"]["reward_batches"] == 1 and "reward_change" in rows["random"]
    assert os.path.exists(os.path.join(out, "diagnose.png"))
    assert "Sign-flip p: exact, over all 2^N sign patterns" in open(os.path.join(out, "diagnose.md")).read()
    from oar.app.stats import break_even_dcos
    g = rows["grpo"]
    assert g["cost_ratio"] is not None and "break_even_dcos" not in g
    r = rows["random"]
    assert r["break_even_dcos"] == pytest.approx(break_even_dcos(g["cos"], g["snr"], r["cost_ratio"]))
    # the reference's folds: leave-one-fold-out weights and norms equal the explicit g_(-c); the intervals (which
    # carry its noise: test_t_with_reference_covers_when_the_reference_is_noisy) are centred on the same mean
    from oar.app.diagnose_report import leave_one_fold_out
    ref = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
    assert len(ref["folds"]) == s.ref_folds and sum(ref["fold_rollouts"]) == ref["rollouts"]
    w, norms = leave_one_fold_out(ref)
    for c in range(s.ref_folds):
        others = [k for k in range(s.ref_folds) if k != c]
        n = sum(ref["fold_rollouts"][k] for k in others)
        g = [sum(ref["folds"][k][i] * (ref["fold_rollouts"][k] / n) for k in others) for i in range(len(ref["grad"]))]
        assert norms[c] == pytest.approx(core.grad_norm(g), rel=1e-5)
    for r in first["rows"]:
        ci, narrow = r["cos_ci"], r["cos_ci_batches_only"]
        assert ci["mean"] == narrow["mean"] == r["cos"] and ci["lo"] < ci["mean"] < ci["hi"]
    # every number of the report from the files small enough to publish (no reference.pt, no sketches/)
    from oar.app.diagnose_report import summarize_stored
    import shutil
    shutil.copytree(out, str(tmp_path / "published"), ignore=shutil.ignore_patterns("reference.pt*", "sketches"))
    stored = json.load(open(os.path.join(out, "diagnose.json")))
    assert json.dumps(summarize_stored(str(tmp_path / "published")), sort_keys=True) == json.dumps(stored, sort_keys=True)
    assert len(stored["sketch_gram"]["gram"]["grpo"]) == len(stored["sketch_gram"]["batches"]) == 3
    # a killed run: the last batch's line is cut; the rerun computes that batch again, and the same numbers
    path = os.path.join(out, "batches.jsonl")
    lines = open(path).read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    again = run(model, tok, _PlantedSource(tok), s, out, progress=False)
    assert _untimed(again["rows"]) == _untimed(first["rows"])
    assert report() == before
    # --batches may grow (a pilot extended): batches 0-2 are kept as they were, batch 3 is added; and shrink back
    def records():
        from oar.app.diagnose_report import _load_batches
        return {b: json.dumps(r, sort_keys=True) for b, r in _load_batches(out).items()}

    kept = records()
    grown = run(model, tok, _PlantedSource(tok), DiagnoseSettings(**{**s.__dict__, "batches": 4}), out, progress=False)
    now = records()
    assert sorted(now) == [0, 1, 2, 3] and all(now[b] == kept[b] for b in (0, 1, 2))
    assert {r["batches"] + r["batches_without_signal"] for r in grown["rows"]} == {4}
    back = run(model, tok, _PlantedSource(tok), s, out, progress=False)
    assert _untimed(back["rows"]) == _untimed(first["rows"])
    # other settings in the same folder are refused, naming the field
    s2 = DiagnoseSettings(**{**s.__dict__, "group": 2})
    with pytest.raises(ValueError, match=r"other settings \(\['group'\]\)"):
        run(model, tok, _PlantedSource(tok), s2, out, progress=False)
    # ... and so are another model / task (provenance) and a folder written by another version of the diagnostic
    with pytest.raises(ValueError, match=r"provenance.model"):
        run(model, tok, _PlantedSource(tok), s, out, progress=False, provenance={"model": {"name": "other"}})
    state = json.load(open(os.path.join(out, "state.json")))
    json.dump({**state, "version": 1}, open(os.path.join(out, "state.json"), "w"))
    with pytest.raises(ValueError, match="another version"):
        run(model, tok, _PlantedSource(tok), s, out, progress=False)


class _SilentSource(_PlantedSource):
    """Every reward 0: no group has signal, every update is 0."""

    def rollouts(self, model, problems, **kw):
        r = super().rollouts(model, problems, **kw)
        r.rewards.zero_()
        return r


def test_reference_resumes_by_fold(tiny, tmp_path):
    """A run stopped inside its reference keeps the folds it finished (reference_fold<c>.pt) and redoes only the
    rest: the same reference as an uninterrupted run (same seeds per fold and chunk), fold files removed at the end."""
    from oar.app.diagnose import DiagnoseSettings, compute_reference

    model, tok = tiny
    s = DiagnoseSettings(methods=["grpo"], batches=1, prompts=2, group=4, ref_prompts=16, ref_group=4,
                         max_new_tokens=4, temperature=1.0, sketch_dim=256, reward_batches=0, step_norm=0.5)
    (tmp_path / "a").mkdir()
    whole = compute_reference(model, tok, _PlantedSource(tok), s, str(tmp_path / "a"))
    out = tmp_path / "b"
    out.mkdir()
    calls = []

    def stop_in_fold_3(n):
        calls.append(n)
        if len(calls) == 3:  # 16 prompts in 4 folds of 4: one progress call per fold; the third is fold 2's
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compute_reference(model, tok, _PlantedSource(tok), s, str(out), progress=stop_in_fold_3)
    assert sorted(p.name for p in out.iterdir()) == ["reference_fold0.pt", "reference_fold1.pt"]
    again = compute_reference(model, tok, _PlantedSource(tok), s, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["reference.pt"]
    assert again["gram"] == whole["gram"] and again["fold_rollouts"] == whole["fold_rollouts"]
    assert again["mean_reward"] == whole["mean_reward"] and again["mixed_groups"] == whole["mixed_groups"]
    assert all(torch.equal(x, y) for x, y in zip(again["grad"], whole["grad"]))


def test_batches_without_signal_are_reported_not_averaged(tiny, tmp_path):
    from oar.app.diagnose import DiagnoseSettings, run

    model, tok = tiny
    s = DiagnoseSettings(methods=["grpo", "random"], batches=2, prompts=2, group=4, ref_prompts=8, ref_group=4,
                         max_new_tokens=4, temperature=1.0, sketch_dim=256, reward_batches=0, step_norm=0.5)
    out = str(tmp_path / "silent")
    summary = run(model, tok, _SilentSource(tok), s, out, progress=False)
    assert summary["batches_without_signal"] == 2
    for r in summary["rows"]:
        assert r["batches"] == 0 and r["batches_without_signal"] == 2 and r["cos"] is None and "dcos" not in r
    assert "0 with signal (+ 2 where no group had two rewards" in open(os.path.join(out, "diagnose.md")).read()


@pytest.mark.parametrize("field,value,msg", [("batches", 1, "batches must be >= 2"),
                                             ("ref_group", 1, "ref_group must be >= 2"),
                                             ("temperature", 0.0, "temperature must be > 0"),
                                             ("methods", ["grpo", "grpo"], r"lists \['grpo'\] more than once"),
                                             ("reward_batches", 25,
                                              r"reward_batches \(25\) must be <= batches \(24\)"),
                                             ("step_scales", [], "step_scales must be a non-empty list"),
                                             ("step_scales", [1.0, 0.0], "step_scales must be a non-empty list"),
                                             ("step_scales", [float("nan")], "step_scales must be a non-empty"),
                                             ("step_scales", [1, 1.0], "lists a scale more than once")])
def test_settings_errors(field, value, msg):
    from oar.app.diagnose import DiagnoseSettings

    with pytest.raises(ValueError, match=msg):
        DiagnoseSettings(**{field: value}).check()


def test_report_marks_a_missing_dcos_as_missing_not_as_the_baseline(tmp_path):
    """A setting without a paired difference (no batch with signal) shows '-' in the Δcos column; only the first
    setting is the baseline."""
    import json

    from _paths import DOCS
    from oar.app.diagnose_report import write_report

    summary = json.loads((DOCS / "diagnose" / "v2-seed0" / "diagnose.json").read_text())
    summary["rows"][1].pop("dcos")
    write_report(summary, str(tmp_path))
    rows = [ln.split(" | ") for ln in (tmp_path / "diagnose.md").read_text().splitlines() if ln.startswith("| ")]
    head = rows[0]
    col = next(k for k, c in enumerate(head) if c.startswith("Δcos"))
    assert rows[1][col] == "(baseline)" and rows[2][col] == "-" and rows[3][col].startswith("+0.0021 [")


# ---- the reward check's step scan (issue 42 item 2) -------------------------------------------------------------

def test_is_reward_change_is_the_self_normalized_estimate():
    """Against the formula written out in float64 per group, plus its two fixed points (no step: 0; all weight on
    one rollout: that rollout's reward) and its shape errors."""
    G = 4
    r = core.Rollouts(prompt_ids=[torch.tensor([1])] * 8, completion_ids=torch.zeros(8, 2, dtype=torch.long),
                      completion_mask=torch.ones(8, 2, dtype=torch.bool),
                      rewards=torch.tensor([1., 0, 0, 1, 0, 0, 0, 1]), group_size=G)
    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    want = 0.0
    for p in range(2):
        d = [float(new[p * G + j] - old[p * G + j]) for j in range(G)]
        e = [np.exp(x - max(d)) for x in d]
        want += sum(e[j] * float(r.rewards[p * G + j]) for j in range(G)) / sum(e) / 2
    want -= float(r.rewards.double().mean())
    assert core.is_reward_change(r, new, old) == pytest.approx(want, abs=1e-12)
    assert core.is_reward_change(r, old, old) == pytest.approx(0.0, abs=1e-15)
    spike = old.clone()
    spike[[0, 4]] += 800.0  # float64 softmax: the other weights underflow to 0
    assert core.is_reward_change(r, spike, old) == pytest.approx((1.0 + 0.0) / 2 - 3 / 8, abs=1e-12)
    with pytest.raises(ValueError, match=r"logp_new must have shape \(8,\).*got \(4,\)"):
        core.is_reward_change(r, new[:4], old)
    bad = new.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="log-probs of row 3: .*logp_new = nan"):
        core.is_reward_change(r, bad, old)


def test_reward_slope_is_the_first_order_term_of_the_is_change(tiny):
    """<delta, reward_slope_gradient> is the derivative of the importance-weighted change at delta = 0: its error
    shrinks like |delta|^2 (halving the step quarters it) while the change itself halves."""
    from oar.app.diagnose import _params, _step_along

    model, tok = tiny
    r0 = _sample(model, tok, _prompts(6), 4, seed=11)
    assert 0 < float(r0.rewards.mean()) < 1
    params = _params(model)
    slope = core.reward_slope_gradient(model, r0, params, tok.pad_token_id)
    lp0 = core.sequence_logprobs(model, r0, tok.pad_token_id)
    u = slope  # the steepest direction: the largest linear term
    n = core.grad_norm(u)
    lin_per_unit = core.grad_dot(u, slope) / n
    errs = []
    for length in (0.005, 0.0025):  # |slope| ~ 8 on this model: a step of 0.005 changes the reward by ~0.04
        with _step_along(model, params, u, length):
            got = core.is_reward_change(r0, core.sequence_logprobs(model, r0, tok.pad_token_id), lp0)
        lin = length * lin_per_unit
        assert got == pytest.approx(lin, rel=0.1)
        errs.append(abs(got - lin))
    assert 3.0 < errs[0] / errs[1] < 6.0  # quadratic: 4 up to the next order and float32 log-probs
    # the leave-one-out gradient is G / (G - 1) times the slope: the scale the linear prediction must not carry
    ref = core.reference_gradient(model, r0, params, tok.pad_token_id)
    assert core.grad_dot(u, ref) / n == pytest.approx(lin_per_unit * 4 / 3, rel=1e-5)


def test_run_scans_step_sizes(tiny, tmp_path):
    """--step-scales: every setting's reward check at each multiple of step_norm; the main column is the scale-1
    step; the scan table is in the report; an earlier run's state without the field resumes at its default."""
    from oar.app.diagnose import DiagnoseSettings, run

    model, tok = tiny
    s = DiagnoseSettings(methods=["grpo", "random"], batches=2, prompts=2, group=4, ref_prompts=8, ref_group=4,
                         max_new_tokens=4, temperature=1.0, sketch_dim=256, reward_batches=2, reward_prompts=6,
                         reward_samples=4, step_norm=0.05, step_scales=[0.5, 1.0, 4.0])
    out = str(tmp_path / "scan")
    summary = run(model, tok, _PlantedSource(tok), s, out, progress=False)
    recs = [json.loads(x) for x in open(os.path.join(out, "batches.jsonl"))]
    for rec in recs:
        for lab, m in rec["methods"].items():
            scan = m["reward_scan"]
            assert [x["scale"] for x in scan] == [0.5, 1.0, 4.0]
            assert [x["step"] for x in scan] == pytest.approx([0.025, 0.05, 0.2], rel=1e-12)
            assert m["reward_change"] == scan[1]["reward_change"]
            assert all(x["reward_change"] == pytest.approx(x["reward_after_step"] - summary["base_reward"], abs=1e-12)
                       for x in scan)
            lin = [x["linear_change"] for x in scan]
            assert lin[2] == pytest.approx(8 * lin[0], rel=1e-9) and lin[1] == pytest.approx(2 * lin[0], rel=1e-9)
    rows = {r["method"]: r for r in summary["rows"]}
    for lab, row in rows.items():
        got = {x["scale"]: x for x in row["reward_scan"]}
        for sc in (0.5, 1.0, 4.0):
            vals = [next(x for x in rec["methods"][lab]["reward_scan"] if x["scale"] == sc) for rec in recs]
            assert got[sc]["reward_change"] == pytest.approx(np.mean([v["reward_change"] for v in vals]), abs=1e-12)
            assert got[sc]["is_change"] == pytest.approx(np.mean([v["is_change"] for v in vals]), abs=1e-12)
    d = [next(x for x in rec["methods"]["random"]["reward_scan"] if x["scale"] == 4.0)["reward_change"]
         - next(x for x in rec["methods"]["grpo"]["reward_scan"] if x["scale"] == 4.0)["reward_change"] for rec in recs]
    assert {x["scale"]: x for x in rows["random"]["reward_scan"]}[4.0]["dreward"] == pytest.approx(np.mean(d))
    md = open(os.path.join(out, "diagnose.md")).read()
    assert "Step scan" in md and "| random | 0.2 (4x) |" in md
    # a state written before step_scales existed resumes (the field compared at its default); another scan does not
    state = json.load(open(os.path.join(out, "state.json")))
    s1 = DiagnoseSettings(**{**state["settings"], "step_scales": [1.0]})
    state["settings"].pop("step_scales")
    json.dump(state, open(os.path.join(out, "state.json"), "w"))
    run(model, tok, _PlantedSource(tok), s1, out, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(\['step_scales'\]\)"):
        run(model, tok, _PlantedSource(tok), s, out, progress=False)


# ---- the margin test (issue 42 item 7) ---------------------------------------------------------------------------

def test_margin_pvalue_matches_the_interval_it_shares_its_error_with():
    """At the 95% interval's lower end the one-sided p is 0.025 and at its upper end 0.975 (same SE and Welch df);
    p falls as the margin falls; with no spread it is 0 or 1; bad margins are refused."""
    from oar.app.stats import margin_pvalue, t_with_reference

    rng = np.random.default_rng(5)
    d, loo = rng.normal(0.01, 0.03, size=40), rng.normal(0.01, 0.004, size=4)
    iv = t_with_reference(d, loo)
    assert margin_pvalue(d, loo, iv.lo) == pytest.approx(0.025, abs=1e-6)
    assert margin_pvalue(d, loo, iv.hi) == pytest.approx(0.975, abs=1e-6)
    assert margin_pvalue(d, loo, iv.mean) == pytest.approx(0.5, abs=1e-9)
    ps = [margin_pvalue(d, loo, m) for m in (0.03, 0.02, 0.0, -0.02)]
    assert ps == sorted(ps, reverse=True)
    assert margin_pvalue([0.1] * 5, [0.1] * 3, 0.05) is None  # no spread: undefined, not a confident 0
    # scale-free: the same data in other units gives the same p (no underflow of squared standard errors)
    x, r = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0])
    p0 = margin_pvalue(x, r, 0.0)
    for k in (1e-160, 1e-300, 1e150):
        assert margin_pvalue(x * k, r * k, 0.0) == pytest.approx(p0, rel=1e-9)
    assert margin_pvalue(d, loo, np.float32(0.01)) == pytest.approx(margin_pvalue(d, loo, 0.01), rel=1e-6)
    with pytest.raises(ValueError, match="overflows"):
        margin_pvalue([1e308, 1e308, -1e308], [0.0, 0.1], 0.0)
    with pytest.raises(ValueError, match="margin must be a finite number"):
        margin_pvalue(d, loo, float("nan"))


def test_run_tests_pre_declared_margins(tiny, tmp_path):
    from oar.app.diagnose import DiagnoseSettings, run
    from oar.app.diagnose_report import summarize_stored
    from oar.app.stats import margin_pvalue

    model, tok = tiny
    s = DiagnoseSettings(methods=["grpo", "random", "random:beta=2"], batches=3, prompts=2, group=4, ref_prompts=8,
                         ref_group=4, max_new_tokens=4, temperature=1.0, sketch_dim=256, reward_batches=0,
                         margins={"random": 0.01})
    out = str(tmp_path / "m")
    summary = run(model, tok, _PlantedSource(tok), s, out, progress=False)
    rows = {r["method"]: r for r in summary["rows"]}
    r = rows["random"]
    assert r["margin"] == 0.01 and "margin" not in rows["random:beta=2"]
    assert r["dcos_minus_margin"]["mean"] == pytest.approx(r["dcos"]["mean"] - 0.01, abs=1e-12)
    assert r["dcos_minus_margin"]["hi"] - r["dcos_minus_margin"]["lo"] == pytest.approx(
        r["dcos"]["hi"] - r["dcos"]["lo"], rel=1e-9)  # a shift: the same interval width
    # the p-value from the stored per-batch cosines and fold dots, recomputed outside the report
    from oar.app.diagnose_report import leave_one_fold_out
    recs = [json.loads(x) for x in open(os.path.join(out, "batches.jsonl"))]
    recs = [x for x in recs if x["signal"]]
    w, nrm = leave_one_fold_out(json.load(open(os.path.join(out, "diagnose.json")))["reference"])

    def loo(lab):
        return np.array([(w @ np.array(x["methods"][lab]["fold_dots"])) / (x["methods"][lab]["norm"] * nrm)
                         for x in recs])

    d = np.array([x["methods"]["random"]["cos"] - x["methods"]["grpo"]["cos"] for x in recs])
    assert r["margin_p"] == pytest.approx(margin_pvalue(d, (loo("random") - loo("grpo")).mean(0), 0.01), abs=1e-12)
    assert "Margin test" in open(os.path.join(out, "diagnose.md")).read()
    assert r["margin_p_holm"] == r["margin_p"]  # one setting tested: Holm leaves its p
    silent = run(model, tok, _SilentSource(tok), DiagnoseSettings(**{**vars(s), "batches": 2}), str(tmp_path / "s"),
                 progress=False)
    assert {r["method"]: r for r in silent["rows"]}["random"]["margin"] == 0.01
    assert "| random | +0.0100 | untestable: 0 batches with signal" in open(tmp_path / "s" / "diagnose.md").read()
    assert summarize_stored(out)["rows"][1]["margin_p"] == pytest.approx(r["margin_p"], abs=1e-12)
    with pytest.raises(ValueError, match=r"other settings \(\['margins'\]\)"):
        run(model, tok, _PlantedSource(tok), DiagnoseSettings(**{**vars(s), "margins": {"random": 0.0}}), out,
            progress=False)


@pytest.mark.parametrize("margins,msg", [({"grpo": 0.01}, "'grpo' is not a compared setting"),
                                         ({"oar_x": 0.01}, "'oar_x' is not a compared setting"),
                                         ({"random": float("inf")}, r"margins\['random'\] must be a number in"),
                                         ([0.01], "margins must be a dict")])
def test_margin_errors(margins, msg):
    from oar.app.diagnose import DiagnoseSettings

    with pytest.raises(ValueError, match=msg):
        DiagnoseSettings(methods=["grpo", "random"], margins=margins).check()


def test_t_cdf_against_closed_forms():
    """Student-t CDFs with closed forms (df = 1: Cauchy, 2, 4) at moderate and extreme x, the normal limit, and the
    quantiles of the published tables far into the tails."""
    from oar.app.stats import _t_cdf

    for x in (-1e9, -37.0, -2.0, -0.3, 1e-6, 0.7, 3.0, 250.0, 1e12):
        assert _t_cdf(x, 1) == pytest.approx(0.5 + np.arctan(x) / np.pi, abs=1e-13)
        assert _t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * np.sqrt(2 + x * x)), abs=1e-13)
        th = np.arctan(x / 2.0)  # df = 4: 1/2 + (3/4) sin(th) (1 - sin(th)^2 / 3)
        assert _t_cdf(x, 4) == pytest.approx(0.5 + 0.75 * np.sin(th) * (1 - np.sin(th) ** 2 / 3), abs=1e-13)
    assert _t_cdf(float("inf"), 1.05) == 1.0 and _t_cdf(-float("inf"), 3) == 0.0
    assert np.isnan(_t_cdf(float("nan"), 3))
    assert t_quantile(0.975, float("inf")) == pytest.approx(1.959963984540054, abs=1e-9)
    assert t_quantile(0.975, 1e14) == pytest.approx(1.959963984540054, abs=1e-9)
    assert t_quantile(0.99999, 1) == pytest.approx(np.tan(np.pi * (0.99999 - 0.5)), rel=1e-8)  # beyond 1e3


def test_is_reward_change_refuses_what_it_cannot_estimate():
    def rollouts(rewards, G):
        n = len(rewards)
        return core.Rollouts(prompt_ids=[torch.tensor([1])] * n, completion_ids=torch.zeros(n, 1, dtype=torch.long),
                             completion_mask=torch.ones(n, 1, dtype=torch.bool),
                             rewards=torch.tensor(rewards, dtype=torch.float32), group_size=G)

    lp = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs >= 2 rollouts per prompt.*group_size = 1"):
        core.is_reward_change(rollouts([1.0, 0, 0, 1], 1), lp, lp)
    with pytest.raises(ValueError, match="B a positive multiple of group_size, got B = 4, group_size = 3"):
        core.is_reward_change(rollouts([1.0, 0, 0, 1], 3), lp, lp)
    with pytest.raises(ValueError, match="reward of row 2 is not finite"):
        core.is_reward_change(rollouts([1.0, 0, float("nan"), 1], 2), lp, lp)
    with pytest.raises(ValueError, match="logp_new must be a floating torch.Tensor of shape \\(4,\\), got ndarray"):
        core.is_reward_change(rollouts([1.0, 0, 0, 1], 2), np.zeros(4), lp)
    with pytest.raises(ValueError, match="got Tensor of dtype torch.int64"):
        core.is_reward_change(rollouts([1.0, 0, 0, 1], 2), torch.zeros(4, dtype=torch.long), lp)
    r = rollouts([1.0, 0, 0, 1], 2)
    new = lp.clone()
    new[1] = -float("inf")  # the new policy cannot produce row 1: prompt 0's weight all on row 0 (reward 1)
    assert core.is_reward_change(r, new, lp) == pytest.approx((1.0 + 0.5) / 2 - 0.5, abs=1e-12)
    new[0] = -float("inf")
    with pytest.raises(ValueError, match="-inf on every row of prompt 0"):
        core.is_reward_change(r, new, lp)
    old = lp.clone()
    old[3] = -float("inf")
    with pytest.raises(ValueError, match="log-probs of row 3: logp_old must be finite"):
        core.is_reward_change(r, lp, old)


def test_settings_normalize_scales_and_margins():
    from oar.app.diagnose import DiagnoseSettings

    s = DiagnoseSettings(methods=["grpo", "oar_g"], step_scales=(np.int64(1), np.float32(4.0)),
                         margins={"oar_g": np.float32(0.25)})
    s.check()
    assert s.step_scales == [1.0, 4.0] and type(s.step_scales[0]) is float
    assert s.margins == {"oar_g": 0.25} and type(s.margins["oar_g"]) is float
    for bad in ([10 ** 400], [True]):
        with pytest.raises(ValueError, match="step_scales must be a non-empty list"):
            DiagnoseSettings(step_scales=bad).check()
    with pytest.raises(ValueError, match=r"margins\['oar_g'\] must be a number in \(-2, 2\)"):
        DiagnoseSettings(methods=["grpo", "oar_g"], margins={"oar_g": 2.5}).check()
    with pytest.raises(ValueError, match="step_norm must be a number in"):
        DiagnoseSettings(step_norm=float("inf")).check()


def test_cli_margins_and_scales_accumulate_and_refuse_repeats(monkeypatch, tmp_path, capsys):
    """Two --margins flags add up (argparse 'extend'), a setting named twice is an error, --step-scales extends."""
    from oar.app import cli

    seen = {}

    def fake_main(config, overrides, out_dir, flags, *, progress=True):
        seen.update(flags)
        raise ValueError("stop here")

    monkeypatch.setattr("oar.app.diagnose.diagnose_main", fake_main)
    monkeypatch.setattr(cli, "_task_problems", lambda *a, **k: None)
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--out", out, "--methods", "grpo", "oar_g", "oar_g:credit_rows=positive",
                  "--margins", "oar_g=0.021", "--margins", "oar_g:credit_rows=positive=0.008",
                  "--step-scales", "0.5", "1", "--step-scales", "4"])
    assert seen["margins"] == {"oar_g": 0.021, "oar_g:credit_rows=positive": 0.008}
    assert seen["step_scales"] == [0.5, 1.0, 4.0]
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--out", out, "--margins", "oar_g=0.01", "oar_g=0.02"])
    assert "--margins names 'oar_g' twice (0.01 and 0.02)" in capsys.readouterr().err
