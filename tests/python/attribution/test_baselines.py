"""oar.baselines: entropy shaping, KTAE statistics and scores, policy entropies, IRPO rewards.

Independent references: exact rational arithmetic (fractions + math.comb) for the Fisher p-value, plain
Python loops over tokens and rollouts for KTAE, a per-row unpadded forward for the entropies, and the
O(n_c * n_r) definition for IRPO.

Error budgets (tests/python/support/_tolerance.py): every function here computes in float64 and rounds its result once
to float32, so a float64 reference is matched within one float32 rounding (half an ulp) plus the two float64
errors, which are far below the other half ulp (:func:`assert_rounded_once`) -- or, where the float64 work
cancels (scores near 0), by rule 1 against the float64 reference (:func:`assert_close_to_rounded`, about 2 ulps
of the largest value).
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar
from oar import baselines, ops
from oar.testing import tiny_random_llama
from oar.attribution import policy_entropies
from _error_model import Bounded, entropy_error_bound
from _tolerance import assert_close_to_rounded, assert_within, assert_within_error_model, gamma, ulp


def assert_rounded_once(out, ref64, what=""):
    """Rule 2 per element for a positive quantity computed in float64 without cancellation (sums of positive
    terms) and rounded once to float32, against an independent float64 value of it: the rounding costs half an
    ulp; both float64 errors (< 1e-10 relative in these tests) fit in the other half (6e-8 relative)."""
    out = torch.as_tensor(out).detach()
    ref64 = torch.as_tensor(ref64, dtype=torch.float64)
    assert_within(out, ref64, ulp(ref64), what)


# ---- Fisher exact test / information gain ---------------------------------------------------------------

def fisher_exact_rational(a, b, c, d):
    """Two-sided Fisher p-value with exact rationals: sum of P(X=k) <= P(X=a)."""
    r1, c1, n = a + b, a + c, a + b + c + d
    denom = math.comb(n, r1)

    def p(k):
        return Fraction(math.comb(c1, k) * math.comb(n - c1, r1 - k), denom)

    lo, hi = max(0, r1 + c1 - n), min(r1, c1)
    pa = p(a)
    return float(sum(p(k) for k in range(lo, hi + 1) if p(k) <= pa))


def info_gain_py(a, b, c, d):
    def h(*xs):
        t = sum(xs)
        return -sum(x / t * math.log2(x / t) for x in xs if x > 0) if t > 0 else 0.0

    n = a + b + c + d
    return h(a + c, b + d) - (a + b) / n * h(a, b) - (c + d) / n * h(c, d) if n else 0.0


@pytest.mark.parametrize("table", [(1, 9, 11, 3), (3, 1, 1, 3), (0, 5, 5, 0), (2, 2, 2, 2), (0, 0, 4, 3),
                                   (4, 3, 0, 0), (7, 0, 0, 1), (12, 5, 1, 9), (0, 0, 0, 0)])
def test_fisher_matches_exact_rationals(table):
    got = float(baselines.fisher_exact_pvalue(torch.tensor([table], dtype=torch.float32))[0])
    if sum(table) == 0:
        assert got == 1.0  # exact: the only table of the support, P = exp(0) = 1
        return
    # n <= 27: lgamma of arguments <= 28 and a sum of <= 28 positive probabilities in float64, rounded once
    assert_rounded_once(got, fisher_exact_rational(*table), str(table))


def test_fisher_known_value():
    # scipy.stats.fisher_exact([[1, 9], [11, 3]]) -> 0.002759... (classic tea-tasting style table). A literature
    # value quoted to 5 significant digits, compared at that precision (not a rounding budget: the exact value
    # is checked against exact rationals in test_fisher_matches_exact_rationals).
    assert float(baselines.fisher_exact_pvalue(torch.tensor([[1, 9, 11, 3]]))[0]) == pytest.approx(0.0027594, rel=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 9)] * 4), min_size=1, max_size=6))
def test_fisher_and_ig_property(tables):
    t = torch.tensor(tables, dtype=torch.int64)
    p = baselines.fisher_exact_pvalue(t)
    ig = baselines.information_gain(t)
    for k, row in enumerate(tables):
        if sum(row) == 0:
            continue
        # p: n <= 36: lgamma of arguments <= 37, a sum of <= 37 positive probabilities in float64, rounded once
        assert_rounded_once(p[k], fisher_exact_rational(*row), f"p {row}")
        # IG = H(Y) - H(Y|X) cancels (0 for proportional rows), so besides the rounding (an ulp, as above) the float64
        # errors are absolute: H(Y) and H(Y|X) are <= 1 bit, built from terms p log2 p of a few float64 operations
        # each (division, log2 within an ulp, product, weighted two-term sums, the difference): within gamma_20
        # bits for the op and again for info_gain_py.
        ref = torch.tensor(info_gain_py(*row), dtype=torch.float64)
        assert_within(ig[k], ref, ulp(ref) + 2 * gamma(20, torch.float64), f"IG {row}")
        # exact bounds: p is clamped to [0, 1]; IG is clamped >= 0 and is <= H(Y) <= 1 in float64 (H(Y|X) >= 0; for
        # n <= 36 only the 1/2 split reaches 1, exactly, the others are > 5e-4 below), and rounding is monotone
        assert 0 < float(p[k]) <= 1 and 0 <= float(ig[k]) <= 1


@pytest.mark.parametrize("bad, match", [(torch.zeros(3, 3), r"\(N, 4\)"), (torch.tensor([[1.5, 1, 1, 1]]), "integer"),
                                        (torch.tensor([[-1, 1, 1, 1]]), "non-negative"), ([1, 2, 3, 4], "torch.Tensor")])
def test_fisher_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        baselines.fisher_exact_pvalue(bad)


# ---- KTAE -----------------------------------------------------------------------------------------------

def ktae_reference(ids, mask, rewards, sizes, alpha=1.0, beta=1.0, tf=True, scale=1.0, threshold=0.0, ignore=()):
    """Loops over groups, token ids and rollouts, following the module docstring of oar.baselines."""
    out = torch.zeros(ids.shape, dtype=torch.float64)
    start = 0
    for g in sizes:
        rows = list(range(start, start + g))
        start += g
        correct = {r for r in rows if float(rewards[r]) > threshold}
        wrong = set(rows) - correct
        if not correct or not wrong:
            continue
        toks = {r: [int(ids[r, t]) for t in range(ids.shape[1]) if mask[r, t]] for r in rows}
        len_c = sum(len(toks[r]) for r in correct)
        len_w = sum(len(toks[r]) for r in wrong)
        avg = (len_c + len_w) / 2
        score = {}
        for u in {x for r in rows for x in toks[r]}:
            a = sum(u in toks[r] for r in correct)
            b = sum(u in toks[r] for r in wrong)
            c, d = len(correct) - a, len(wrong) - b
            p = fisher_exact_rational(a, b, c, d)
            fish = 0.0 if p >= 1 - 1e-9 else math.exp(-2 * p)
            ig = info_gain_py(a, b, c, d)
            h = math.asin(math.sqrt(a / len(correct))) - math.asin(math.sqrt(b / len(wrong)))
            if tf:
                def sat(count, length):
                    if length == 0:
                        return 0.0
                    f = count / length
                    return f * 3.0 / (f + 2.0 * (0.5 + 0.5 * length / avg))

                tc = sat(sum(toks[r].count(u) for r in correct), len_c)
                tw = sat(sum(toks[r].count(u) for r in wrong), len_w)
                h += tc / (tw + 1e-5) - tw / (tc + 1e-5)
            s = (alpha * fish + beta * ig) * h / (alpha + beta)
            score[u] = 0.0 if u in ignore else scale * math.tanh(s / 2)  # = scale * (2 sigmoid(s) - 1)
        for r in rows:
            for t in range(ids.shape[1]):
                if mask[r, t]:
                    out[r, t] = score[int(ids[r, t])]
    return out  # float64: the reference of rule 1


def _ktae_batch(seed, sizes=(6, 5), T=9, vocab=7):
    g = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    return ids, mask, rewards


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kw", [{}, {"tf": False}, {"alpha": 0.0, "beta": 2.0}, {"alpha": 1.0, "beta": 0.0, "scale": 0.5},
                                {"threshold": 0.5, "ignore": (3,)}])
def test_ktae_matches_loop_reference(seed, kw):
    ids, mask, rewards = _ktae_batch(seed)
    ignore = kw.pop("ignore", ())
    got = baselines.ktae_token_scores(ids, mask, rewards, [0, 6, 11], ignore_ids=ignore, **kw)
    exp = ktae_reference(ids, mask, rewards, (6, 5), ignore=ignore, **kw)
    # float64 scores rounded once; 2 sigmoid(s) - 1 and the direction h cancel near 0, so their float64 errors are
    # absolute (~1e-16 of scale): rule 1 on the whole tensor (2 float32 roundings + an ulp of the largest score)
    assert_close_to_rounded(got, exp, what=str(kw))


@pytest.mark.parametrize("seed", [0, 1])
def test_ktae_group_ids_in_any_row_order(seed):
    # Rows of the two prompts interleaved / shuffled (verl's balance_batch): each row gets the scores of its own
    # group, as when the rows are contiguous.
    ids, mask, rewards = _ktae_batch(seed)
    want = ktae_reference(ids, mask, rewards, (6, 5))
    g = torch.tensor([0] * 6 + [1] * 5)
    p = torch.randperm(11, generator=torch.Generator().manual_seed(seed))
    got = baselines.ktae_token_scores(ids[p], mask[p], rewards[p], group_ids=[f"uid-{v}" for v in g[p].tolist()])
    assert_close_to_rounded(got, want[p], what="shuffled rows")  # float64 scores rounded once, as above
    # exact: a group's scores depend on its rows only through integer counts (tables, histograms, lengths) and
    # the sorted token ids, so the shuffled group runs the same float64 operations as the contiguous one
    same = baselines.ktae_token_scores(ids, mask, rewards, [0, 6, 11])
    torch.testing.assert_close(got, same[p], rtol=0, atol=0)


def test_ktae_invariants():
    ids, mask, rewards = _ktae_batch(5, sizes=(8,), T=12)
    rewards[:3], rewards[3:] = 1.0, 0.0
    s = baselines.ktae_token_scores(ids, mask, rewards, group_size=8, scale=0.7)
    assert (s.abs() < 0.7).all() and (s[~mask] == 0).all()
    # swapping correct and wrong flips every score (the statistics are symmetric, the direction antisymmetric)
    flipped = baselines.ktae_token_scores(ids, mask, 1 - rewards, group_size=8, scale=0.7)
    # The transposed tables run the same float64 formulas with sums in another order and lgamma at other
    # arguments (float64 differences < 1e-10 of scale); each score is then rounded once to float32 (half an ulp
    # each): within one float32 ulp of the largest score.
    assert_within(flipped, -s, ulp(s.abs().max()), "flipped correct/wrong")
    # a group with only correct (or only wrong) rollouts scores 0
    assert (baselines.ktae_token_scores(ids, mask, torch.ones(8), group_size=8) == 0).all()
    # a token present in every correct rollout and in no wrong one is a positive key token
    ids2 = ids.clone() % 5
    ids2[:3, 0] = 6
    mask2 = mask.clone()
    mask2[:, 0] = True
    s2 = baselines.ktae_token_scores(ids2, mask2, rewards, group_size=8, tf=False)
    assert (s2[:3, 0] > 0.05).all()


def test_ktae_advantages_add_scores_and_keep_padding_zero():
    ids, mask, rewards = _ktae_batch(3)
    adv = ops.group_advantages(rewards, [0, 6, 11])
    tok = baselines.ktae_advantages(adv, ids, mask, rewards, [0, 6, 11])
    bonus = baselines.ktae_token_scores(ids, mask, rewards, [0, 6, 11])
    # exact: A + bonus of two float32 values rounded to float32 directly or through float64 (53 >= 2 * 24 + 2 bits:
    # the double rounding is innocuous) gives the same float32; * mask multiplies by 1 or 0
    torch.testing.assert_close(tok, (adv[:, None] + bonus) * mask, rtol=0, atol=0)
    assert (tok[~mask] == 0).all()


@pytest.mark.parametrize("kw, match", [({"alpha": 0.0, "beta": 0.0}, "alpha \\+ beta"), ({"scale": 0.0}, "scale"),
                                       ({"alpha": -1.0}, "alpha"), ({"threshold": float("nan")}, "threshold")])
def test_ktae_bad_parameters(kw, match):
    ids, mask, rewards = _ktae_batch(0)
    with pytest.raises(ValueError, match=match):
        baselines.ktae_token_scores(ids, mask, rewards, [0, 6, 11], **kw)


def test_ktae_bad_input():
    ids, mask, rewards = _ktae_batch(0)
    with pytest.raises(ValueError, match="rewards must be"):
        baselines.ktae_token_scores(ids, mask, rewards[:3], [0, 6, 11])
    with pytest.raises(ValueError, match="token_ids must be an integer"):
        baselines.ktae_token_scores(ids.float(), mask, rewards, [0, 6, 11])
    with pytest.raises(ValueError, match="mask must be"):
        baselines.ktae_token_scores(ids, mask[:, :3], rewards, [0, 6, 11])
    with pytest.raises(ValueError, match="rewards must be finite"):
        baselines.ktae_token_scores(ids, mask, torch.full((11,), float("nan")), [0, 6, 11])
    with pytest.raises(ValueError, match="offsets"):
        baselines.ktae_token_scores(ids, mask, rewards, [0, 6, 10])


# ---- entropy shaping ----------------------------------------------------------------------------------------

def test_entropy_shaping_formula_and_invariants():
    g = torch.Generator().manual_seed(0)
    adv = torch.tensor([1.5, -0.8, 0.0, 0.3], dtype=torch.float64)
    ent = torch.rand((4, 7), generator=g, dtype=torch.float64) * 3
    mask = torch.rand((4, 7), generator=g) > 0.3
    out = baselines.entropy_shaping_advantages(adv, ent, mask, alpha=0.4, kappa=2.0)
    exp = torch.zeros(4, 7, dtype=torch.float64)
    for i in range(4):
        for t in range(7):
            if mask[i, t]:
                exp[i, t] = adv[i] + min(0.4 * ent[i, t], abs(adv[i]) / 2.0)
    # exact: the same float64 operations (a product, a halving, a min, a sum; each correctly rounded, no
    # reduction) on the same float64 inputs, rounded once to float32
    torch.testing.assert_close(out, exp.float(), rtol=0, atol=0)
    assert out.dtype == torch.float32
    assert (out[2] == 0).all() and (out[~mask] == 0).all()
    assert (out[1][mask[1]] < 0).all()  # kappa > 1: a negative advantage stays negative
    # the bonus out - A is at most the cap |A| / kappa, up to out's own rounding to float32 (half an ulp of out;
    # the other half covers the float64 subtraction of this check)
    assert ((out.double() - adv[:, None] * mask) <= adv.abs()[:, None] / 2 + ulp(out)).all()


@pytest.mark.parametrize("kw, match", [({"alpha": -1}, "alpha"), ({"kappa": 0}, "kappa"), ({"kappa": "2"}, "kappa")])
def test_entropy_shaping_bad_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        baselines.entropy_shaping_advantages(torch.ones(2), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), **kw)


def test_entropy_shaping_bad_input():
    with pytest.raises(ValueError, match="entropy must be >= 0"):
        baselines.entropy_shaping_advantages(torch.ones(1), -torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages must be"):
        baselines.entropy_shaping_advantages(torch.ones(3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="entropy must be finite"):
        baselines.entropy_shaping_advantages(torch.ones(1), torch.full((1, 2), float("inf")), torch.ones(1, 2))
    # values off the mask are ignored
    out = baselines.entropy_shaping_advantages(torch.ones(1), torch.tensor([[1.0, float("nan")]]),
                                               torch.tensor([[True, False]]))
    # exact: 1 + min(0.4 * 1, 1 / 2) in float64, rounded once to float32
    assert out.tolist() == [[torch.tensor(1.0 + 0.4, dtype=torch.float64).float().item(), 0.0]]


def test_policy_entropies_match_unpadded_forward():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    C = 6
    ids = torch.tensor([[20, 21, 22, 23, 0, 0], [30, 31, 32, 33, 34, 35], [40, 41, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    got = policy_entropies(model, prompts, ids, mask, memory_budget_mb=1)
    # rule 1: the unpadded per-row forward on the float64 model (the truth) with its float32 error model; the padded
    # batched forward under test within it
    value, bound, bound_ref = (torch.zeros(3, C, dtype=torch.float64) for _ in range(3))
    for i in range(3):
        L = int(mask[i].sum())
        P = len(prompts[i])
        e = entropy_error_bound(model, torch.tensor([prompts[i] + ids[i, :L].tolist()]), P - 1, P - 1 + L)
        value[i, :L], bound[i, :L], bound_ref[i, :L] = e.value, e.bound, e.bound_ref
    assert_within_error_model(got, Bounded(value, bound, bound_ref), what="policy entropies")
    assert (got[~mask] == 0).all()


def test_policy_entropies_bad_input():
    model, tok = tiny_random_llama(hidden_size=16, num_layers=1, num_heads=2, tokenizer="minimal", seed=1)
    with pytest.raises(ValueError, match="prompt_ids\\[0\\] is empty"):
        policy_entropies(model, [[]], torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="prompt_ids must have"):
        policy_entropies(model, [[1], [2]], torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool))


# ---- IRPO ---------------------------------------------------------------------------------------------------

def irpo_quadratic(sc, sr):
    sig = torch.sigmoid(sc.double()[:, None] - sr.double()[None, :])
    return sig.mean(1), sig.mean(0)  # float64


@pytest.mark.parametrize("n_c, n_r", [(1, 1), (3, 5), (8, 8), (47, 3)])
def test_irpo_matches_quadratic_definition(n_c, n_r):
    g = torch.Generator().manual_seed(n_c * 100 + n_r)
    sc, sr = torch.randn(n_c, generator=g) * 3, torch.randn(n_r, generator=g) * 3
    got = oar.irpo_rewards(sc, sr)
    exp = irpo_quadratic(sc, sr)
    for a, b in zip(got, exp):  # means of <= 47 positive sigmoids in float64, rounded once
        assert_rounded_once(a, b, f"{n_c} x {n_r}")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=30), st.lists(st.integers(1, 10), min_size=1, max_size=30),
       st.integers(1, 4))
def test_irpo_discrete_scores_property(c, r, chunk):
    sc, sr = torch.tensor(c, dtype=torch.float32), torch.tensor(r, dtype=torch.float32)
    r_c, r_r = baselines.irpo_rewards(sc, sr, chunk=chunk)
    e_c, e_r = irpo_quadratic(sc, sr)
    assert_rounded_once(r_c, e_c, "r_c")  # means of <= 30 positive sigmoids in float64, rounded once
    assert_rounded_once(r_r, e_r, "r_r")
    assert ((r_c > 0) & (r_c < 1)).all() and ((r_r > 0) & (r_r < 1)).all()
    # Bradley-Terry identity: mean_i r_c[i] = mean_j r_r[j] (both are the mean M of all n_c * n_r sigmoids). Each
    # reward is rounded once to float32 (u M per mean: ulp(M) for both); the float64 work (the op's dot products
    # and divisions, this check's means) is within gamma_{n_c + n_r + 4} of M for each of the 4.
    mc, mr = float(r_c.double().mean()), float(r_r.double().mean())
    M = max(mc, mr)
    assert abs(mc - mr) <= ulp(M) + 4 * gamma(len(c) + len(r) + 4, torch.float64) * M


def test_irpo_large_discrete_groups_are_not_quadratic():
    # 200k x 200k pairwise sigmoids would take minutes and 160 GB; distinct values make it 10 x 10.
    g = torch.Generator().manual_seed(0)
    sc = torch.randint(1, 11, (200_000,), generator=g).float()
    sr = torch.randint(1, 11, (200_000,), generator=g).float()
    r_c, r_r = oar.irpo_rewards(sc, sr)
    for i in (0, 17, 199_999):  # the definition, row by row (O(n) each)
        # float64 means of 2e5 positive sigmoids (error < gamma_2e5(float64) = 2e-11 relative), rounded once
        assert_rounded_once(r_c[i], torch.sigmoid(sc[i].double() - sr.double()).mean(), f"r_c[{i}]")
        assert_rounded_once(r_r[i], torch.sigmoid(sc.double() - sr[i].double()).mean(), f"r_r[{i}]")


def test_irpo_advantages_normalize_each_group():
    sc, sr = torch.tensor([7.0, 8.0, 7.0, 9.0]), torch.tensor([3.0, 7.0, 5.0])
    a_c, a_r = oar.irpo_advantages(sc, sr, preset="trl")
    r_c, r_r = oar.irpo_rewards(sc, sr)
    e_c, e_r = irpo_quadratic(sc, sr)
    assert_rounded_once(r_c, e_c, "r_c")  # the rewards: the definition in float64, rounded once
    assert_rounded_once(r_r, e_r, "r_r")
    # exact: the same op on the same rewards (the grpo statistics of a group read that group's rows only)
    torch.testing.assert_close(a_c, ops.group_advantages(r_c, group_size=4, preset="trl"), rtol=0, atol=0)
    torch.testing.assert_close(a_r, ops.group_advantages(r_r, group_size=3, preset="trl"), rtol=0, atol=0)
    # the judgment that ranks the chosen response highest gets the largest advantage
    assert int(a_c.argmax()) == 3 and int(a_r.argmax()) == 0


@pytest.mark.parametrize("args, match", [((torch.zeros(0), torch.ones(2)), "non-empty"),
                                         ((torch.ones(2, 1), torch.ones(2)), "1-D"),
                                         ((torch.tensor([1.0, float("nan")]), torch.ones(2)), "finite"),
                                         ((torch.ones(2), [1.0]), "torch.Tensor")])
def test_irpo_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        oar.irpo_rewards(*args)


# ---- bad input: one table ----------------------------------------------------------------------------------------
# Each row: (the function, its keyword arguments, the exception, a regex of the message).

_IDS = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
_M = torch.ones(4, 5, dtype=torch.bool)
_R = torch.tensor([1.0, 0.0, 1.0, 0.0])

BAD_INPUT = [
    # Finite float64 advantages beyond float32 used to come back as inf.
    pytest.param(baselines.entropy_shaping_advantages,
                 dict(advantages=torch.tensor([1e300, 1.0], dtype=torch.float64), entropy=torch.rand(2, 3),
                      mask=torch.ones(2, 3, dtype=torch.bool)),
                 ValueError, r"advantages must fit in float32 .*got advantages\[\d+, \d+\] = ", id="entropy_shaping_float32_overflow"),
    pytest.param(baselines.ktae_token_scores, dict(token_ids=_IDS, mask=_M, rewards=_R, group_size=2, scale=1e300),
                 ValueError, r"scale must be > 0 and fit in float32 .* got 1e\+300", id="ktae_scale_beyond_float32"),
    pytest.param(baselines.ktae_advantages,
                 dict(advantages=torch.tensor([1e300, -1.0, 1.0, -1.0], dtype=torch.float64), token_ids=_IDS, mask=_M,
                      rewards=_R, group_size=2),
                 ValueError, r"advantages must fit in float32 .*got advantages\[\d+, \d+\] = ", id="ktae_advantages_float32_overflow"),
    # Used to be TypeError: 'NoneType' object is not iterable.
    pytest.param(baselines.ktae_token_scores,
                 dict(token_ids=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3), rewards=torch.tensor([1.0, 0.0]),
                      group_size=2, ignore_ids=None),
                 ValueError, r"ignore_ids must be a sequence of int token ids, got NoneType", id="ktae_ignore_ids_none"),
    pytest.param(baselines.ktae_token_scores,
                 dict(token_ids=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3), rewards=torch.tensor([1.0, 0.0]),
                      group_size=2, ignore_ids=5),
                 ValueError, r"ignore_ids must be a sequence of int token ids, got int 5", id="ktae_ignore_ids_int"),
    # n = 1e9 used to allocate a (rows, n + 1) float64 table (8 GB per row).
    pytest.param(baselines.fisher_exact_pvalue, dict(table=torch.tensor([[1e9, 2.0, 3.0, 4.0]])), ValueError,
                 r"table counts too large: row 0 has n = .* > 1000000", id="fisher_huge_counts"),
    # The imaginary part used to be dropped silently.
    pytest.param(baselines.information_gain, dict(table=torch.tensor([[1, 2, 3, 4]]).to(torch.complex64)), ValueError,
                 r"table must hold counts, got dtype torch\.complex64", id="information_gain_complex"),
]


@pytest.mark.parametrize("fn, kwargs, exc, match", BAD_INPUT)
def test_bad_input(fn, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(**kwargs)


def test_ktae_ignore_ids_accepts_an_integer_tensor():
    torch.testing.assert_close(baselines.ktae_token_scores(_IDS, _M, _R, group_size=2, ignore_ids=torch.tensor([1, 2])),
                               baselines.ktae_token_scores(_IDS, _M, _R, group_size=2, ignore_ids=[1, 2]),
                               rtol=0, atol=0)  # exact: the same computation on the same inputs
