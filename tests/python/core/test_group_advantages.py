"""oar.ops.group_advantages (method.md section 1) against the float64 reference and against each trainer's
own formula, written out independently (TRL GRPOTrainer: support/_trainer_formulas.py, shared with the multi-process
TRL test; verl compute_grpo_outcome_advantage / compute_rloo_outcome_advantage, OpenRLHF experience_maker group_norm
/ rloo / dr_grpo: here); group ids in any row
order against a per-group loop; every device (``device``: "cpu", and "cuda" where a GPU and the CUDA kernels
are present; the CUDA cases compare against the CPU op too); bad input as one table; torch.compile of the
wrapper.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import groups, ops
from oar import reference as ref

from _devices import DEVICES, OTHER_DEVICES, eager_checks, gen, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401
from _tolerance import assert_close_to_rounded, assert_within, gamma, ulp
from _trainer_formulas import trl_advantages

ESTIMATORS = ["grpo", "dr_grpo", "batch", "rloo"]
PRESETS = [None, "trl", "verl", "openrlhf"]


def ragged_offsets(sizes):
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    return torch.tensor(off, dtype=torch.int64)


def rewards_for(n, seed, kind="binary"):
    g = torch.Generator().manual_seed(seed)
    if kind == "binary":
        return torch.randint(0, 2, (n,), generator=g).float()
    return torch.randn(n, generator=g) * 3 + 1


# ---- against the reference --------------------------------------------------------------------------------

# Empty groups, singletons, all-equal groups (likely with binary rewards) and odd sizes 3/47/131.
SIZES = [0, 1, 3, 2, 47, 0, 1, 131, 8, 5]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_matches_reference(estimator, preset, kind):
    off = ragged_offsets(SIZES)
    r = rewards_for(int(off[-1]), seed=len(SIZES), kind=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mixed group sizes: no singleton-only warning
        got = ops.group_advantages(r, off, estimator=estimator, preset=preset)
    want = ref.group_advantages(r, off, estimator=estimator, preset=preset)
    assert got.dtype == torch.float32 and got.shape == r.shape
    # The op and the reference (float32 output) both compute in float64 and round once: rule 1 of _tolerance.py
    # with the rounded reference, i.e. within about one ulp of the largest value.
    assert_close_to_rounded(got, want)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_biased_std_and_explicit_eps(estimator):
    off = ragged_offsets([4, 3, 6])
    r = rewards_for(13, seed=2, kind="normal")
    got = ops.group_advantages(r, off, estimator=estimator, std="biased", eps=0.0)
    want = ref.group_advantages(r, off, estimator=estimator, std="biased", eps=0.0)
    assert_close_to_rounded(got, want)


def test_edge_groups_hand_values():
    # groups: [] | [5] | [2, 2, 2] | [1, 0]
    r = torch.tensor([5.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    off = [0, 0, 1, 4, 6]
    got = ops.group_advantages(r, off, eps=0.0)
    s = (0.5**2 * 2 / 1) ** 0.5  # unbiased std of {1, 0}
    want = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5 / s, -0.5 / s])
    torch.testing.assert_close(got, want)
    assert (got[:4] == 0).all()  # exact zeros for the singleton and the constant group


def test_constant_rewards_are_exactly_zero_whatever_the_value():
    # 0.1 is not representable: float mean - value need not vanish, but the op compares values.
    for v in [0.1, 1e-7, 123456.7, -3.3]:
        r = torch.full((12,), v)
        for est in ESTIMATORS:
            out = ops.group_advantages(r, group_size=4, estimator=est, eps=0.0)
            assert torch.equal(out, torch.zeros(12)), (v, est)


def test_empty_input():
    out = ops.group_advantages(torch.empty(0), [0])
    assert out.shape == (0,) and out.dtype == torch.float32
    assert ops.group_advantages(torch.empty(0), group_size=4).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool])
def test_dtypes_are_promoted(dtype):
    r = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.float32)
    low = r.to(dtype)
    got = ops.group_advantages(low, group_size=3)
    want = ref.group_advantages(low.to(torch.float64), group_size=3)
    assert got.dtype == torch.float32
    assert_close_to_rounded(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rewards_computed_in_float32(dtype):
    # Half-precision statistics would be off by ~1e-3 relative; the op reads the values as float32 and
    # accumulates in double, so it matches the float64 reference of the same (rounded) values to 1e-5.
    r = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 10 + 50).to(dtype)
    for est in ESTIMATORS:
        got = ops.group_advantages(r, group_size=16, estimator=est)
        want = ref.group_advantages(r.double(), group_size=16, estimator=est)
        assert_close_to_rounded(got, want, what=est)


def test_non_contiguous_rewards():
    base = rewards_for(40, seed=5, kind="normal")
    r = base[::2]
    assert not r.is_contiguous()
    want = ops.group_advantages(r.contiguous(), group_size=5)
    torch.testing.assert_close(ops.group_advantages(r, group_size=5), want)
    off = torch.tensor([0, 7, 20, 0, 0])[:3]  # a view as offsets
    assert_close_to_rounded(ops.group_advantages(r, off), ref.group_advantages(r, off))


# ---- grouping arguments -------------------------------------------------------------------------------------


def test_group_ids_and_group_size_match_offsets():
    r = rewards_for(12, seed=3, kind="normal")
    by_off = ops.group_advantages(r, [0, 4, 8, 12])
    torch.testing.assert_close(ops.group_advantages(r, group_size=4), by_off)
    torch.testing.assert_close(ops.group_advantages(r, group_ids=torch.tensor([7] * 4 + [3] * 4 + [9] * 4)), by_off)
    uids = ["a"] * 4 + ["b"] * 4 + ["c"] * 4  # verl's uid strings
    torch.testing.assert_close(ops.group_advantages(r, group_ids=uids), by_off)
    ragged = ops.group_advantages(r, group_ids=[0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3])
    torch.testing.assert_close(ragged, ops.group_advantages(r, [0, 3, 4, 9, 12]))


def test_grouping_errors():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="group_ids must have one id per reward, N = 6, got 5"):
        ops.group_advantages(r, group_ids=[0, 0, 1, 1, 1])
    with pytest.raises(ValueError, match="group_ids must hold integer ids"):
        ops.group_advantages(r, group_ids=torch.zeros(6))
    with pytest.raises(ValueError, match="exactly one of offsets, group_ids, group_size"):
        ops.group_advantages(r, [0, 6], group_size=3)
    with pytest.raises(ValueError, match="exactly one of offsets, group_ids, group_size"):
        ops.group_advantages(r)
    with pytest.raises(ValueError, match="group_size must divide the number of rewards N = 6, got group_size = 4"):
        ops.group_advantages(r, group_size=4)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        ops.group_advantages(r, group_size=0)


# ---- group ids in any row order ---------------------------------------------------------------------------------


def per_group_loop(r, ids, **kw):
    """Independent reference for group ids in any row order: a Python loop gathers each group's rows, calls the
    reference on them as one contiguous group and writes the result back to the same rows (not for the
    ``batch`` estimator, whose divisor is a statistic of the whole batch)."""
    out = torch.zeros(len(ids))
    for gid in dict.fromkeys(ids):
        rows = [i for i, v in enumerate(ids) if v == gid]
        out[rows] = ref.group_advantages(r[rows], group_size=len(rows), **kw)
    return out


def grouped_by_python(r, ids, **kw):
    """Independent reference for every estimator: the rows sorted by group (Python's stable sort, groups in
    order of first appearance), the reference on that contiguous layout, scattered back to the rows."""
    first = {}
    for i, v in enumerate(ids):
        first.setdefault(v, i)
    perm = sorted(range(len(ids)), key=lambda i: first[ids[i]])
    sizes = [sum(1 for v in ids if v == gid) for gid in sorted(first, key=first.get)]
    off = ragged_offsets(sizes)
    out = torch.empty(len(ids))
    out[perm] = ref.group_advantages(r[perm], off, **kw)
    return out


def layouts(sizes, seed):
    """Group ids of ragged groups in three row orders: contiguous, interleaved (round-robin over the groups, as
    rollout engines that sample one response per prompt at a time emit them) and shuffled (a random
    permutation, like verl's balance_batch reordering)."""
    contiguous = [g for g, n in enumerate(sizes) for _ in range(n)]
    interleaved = []
    left = list(sizes)
    while any(left):
        for g in range(len(sizes)):
            if left[g]:
                interleaved.append(g)
                left[g] -= 1
    p = torch.randperm(len(contiguous), generator=gen(seed)).tolist()
    return {"contiguous": contiguous, "interleaved": interleaved, "shuffled": [contiguous[i] for i in p]}


@pytest.mark.parametrize("layout", ["interleaved", "shuffled"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("preset", PRESETS)
def test_group_ids_in_any_row_order_match_a_per_group_loop(layout, estimator, preset):
    sizes = [4, 1, 7, 3, 2, 5, 1, 8]  # singletons (verl's quirk), odd sizes
    ids = layouts(sizes, seed=len(layout))[layout]
    r = rewards_for(len(ids), seed=21, kind="normal")
    r[[i for i, v in enumerate(ids) if v == 3]] = 0.25  # an all-equal group: exactly 0
    got = ops.group_advantages(r, group_ids=ids, estimator=estimator, preset=preset)
    assert got.dtype == torch.float32 and got.shape == r.shape
    kw = dict(estimator=estimator, preset=preset)
    assert_close_to_rounded(got, grouped_by_python(r, ids, **kw))
    if estimator != "batch":
        assert_close_to_rounded(got, per_group_loop(r, ids, **kw))
    assert torch.equal(got[[i for i, v in enumerate(ids) if v == 3]], torch.zeros(3))
    # The same ids as strings (verl's uid), as an integer tensor, and as another set of labels.
    torch.testing.assert_close(ops.group_advantages(r, group_ids=[f"uid-{v}" for v in ids], **kw), got, rtol=0, atol=0)
    torch.testing.assert_close(ops.group_advantages(r, group_ids=torch.tensor(ids), **kw), got, rtol=0, atol=0)
    torch.testing.assert_close(ops.group_advantages(r, group_ids=[100 - 7 * v for v in ids], **kw), got, rtol=0,
                               atol=0)


def test_interleaved_hand_values():
    # Rows alternate between two prompts: group 0 = rows {0, 2, 4} = {1, 0, 2}, group 1 = rows {1, 3} = {5, 3}.
    r = torch.tensor([1.0, 5.0, 0.0, 3.0, 2.0])
    got = ops.group_advantages(r, group_ids=["a", "b", "a", "b", "a"], eps=0.0)
    s0 = 1.0  # unbiased std of {1, 0, 2}
    s1 = 2.0**0.5  # unbiased std of {5, 3}
    want = torch.tensor([0.0 / s0, 1.0 / s1, -1.0 / s0, -1.0 / s1, 1.0 / s0])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_verl_preset_on_a_reordered_batch(norm_by_std):
    # verl groups by uid whatever the order (its dict of lists): after balance_batch the rows are permuted.
    sizes = [5, 1, 4, 1, 7, 3]
    ids = layouts(sizes, seed=5)["shuffled"]
    index = [f"uid-{g}" for g in ids]
    r = rewards_for(len(index), seed=4, kind="normal")
    want = verl_grpo(r, index, norm_adv_by_std_in_grpo=norm_by_std)
    got = ops.group_advantages(r, group_ids=index, preset="verl", estimator="grpo" if norm_by_std else "dr_grpo")
    # The op accumulates in float64 and rounds once: verl's formula in float64, rounded (rule 1, no second float32
    # path); verl's own float32 run agrees to its rounding.
    assert_close_to_rounded(got, verl_grpo(r.double(), index, norm_adv_by_std_in_grpo=norm_by_std))
    assert want.dtype == torch.float32


def test_group_ids_in_any_order_skip_nan_and_singleton_warning():
    ids = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    r = torch.tensor([1.0, 0.0, 2.0, float("nan"), 4.0, 1.0, 3.0, 1.0, float("nan")])
    got = ops.group_advantages(r, group_ids=ids, skip_nan=True)
    assert_close_to_rounded(got, per_group_loop(r, ids, skip_nan=True))
    assert got[3] == 0 and got[8] == 0
    # Every group has one response left once NaN rows are out: warned, as for contiguous groups.
    r1 = torch.tensor([1.0, 0.0, float("nan"), float("nan"), 5.0, float("nan")])
    with pytest.warns(UserWarning, match="every group has a single response"):
        out = ops.group_advantages(r1, group_ids=[7, 8, 7, 8, 9, 9], skip_nan=True)
    assert torch.equal(out, torch.zeros(6))
    with pytest.warns(UserWarning, match="every group has a single response"):
        ops.group_advantages(torch.tensor([1.0, 0.0, 1.0]), group_ids=["c", "a", "b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.group_advantages(torch.tensor([1.0, 0.0, 1.0, 2.0]), group_ids=["a", "b", "a", "b"])


@pytest.mark.parametrize("bad, value, match", [
    (float("nan"), "nan", r"rewards must not contain NaN, got rewards\[{row}\] = nan"),
    (float("inf"), "inf", r"rewards must be finite, got rewards\[{row}\] = inf"),
])
@pytest.mark.parametrize("row", [1, 4, 6])
def test_errors_name_the_callers_row(bad, value, match, row):
    # Grouped layout of ids [0, 1, 0, 1, 2, 0, 2] is rows [0, 2, 5, 1, 3, 4, 6]: row 1 sits at position 3 there,
    # row 4 at 5, row 6 at 6; the message must name the caller's row.
    r = torch.arange(7, dtype=torch.float32)
    r[row] = bad
    with pytest.raises(ValueError, match=match.format(row=row)):
        ops.group_advantages(r, group_ids=[0, 1, 0, 1, 2, 0, 2])


def test_group_ids_tensor_grouping_matches_the_list_grouping():
    ids = [3, 1, 3, 2, 1, 3, 9, 2]
    a = groups.resolve_groups(torch.zeros(8), group_ids=ids)
    b = groups.resolve_groups(torch.zeros(8), group_ids=torch.tensor(ids))
    # Groups numbered by first row (3, 1, 2, 9), rows kept in their order within a group.
    assert a.offsets.tolist() == b.offsets.tolist() == [0, 3, 5, 7, 8]
    assert a.order.tolist() == b.order.tolist() == [0, 2, 5, 1, 4, 3, 7, 6]
    assert groups.resolve_groups(torch.zeros(4), group_ids=torch.tensor([5, 5, 2, 2])).order is None
    assert groups.resolve_groups(torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long)).offsets.tolist() == [0]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=9),
    seed=st.integers(0, 2**31 - 1),
    estimator=st.sampled_from(ESTIMATORS),
    preset=st.sampled_from(PRESETS),
    id_kind=st.sampled_from(["list", "str", "tensor"]),
    nan_rows=st.integers(0, 3),
)
def test_property_permutation_invariance(sizes, seed, estimator, preset, id_kind, nan_rows):
    """group_advantages(r[p], group_ids=g[p]) == group_advantages(r, group_ids=g)[p] for any permutation p.

    The op accumulates in double and rounds once to float32; a permutation only reorders the sums within a
    group (double rounding, ~1e-16 relative), so results agree to 2 float32 ulps."""
    n = sum(sizes)
    g = torch.tensor([k for k, s in enumerate(sizes) for _ in range(s)])
    r = rewards_for(n, seed=seed, kind="normal").double()
    nan = torch.randperm(n, generator=gen(seed + 1))[:nan_rows]
    r[nan] = float("nan")
    p = torch.randperm(n, generator=gen(seed + 2))

    def ids(t):
        return t.tolist() if id_kind == "list" else [f"u{v}" for v in t.tolist()] if id_kind == "str" else t

    kw = dict(estimator=estimator, preset=preset, skip_nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = ops.group_advantages(r, group_ids=ids(g), **kw)
        permuted = ops.group_advantages(r[p], group_ids=ids(g[p]), **kw)
    torch.testing.assert_close(permuted, base[p], rtol=2.5e-7, atol=1e-12)
    assert torch.equal(permuted[torch.isnan(r[p])], torch.zeros(int(torch.isnan(r).sum())))


# ---- NaN / Inf ----------------------------------------------------------------------------------------------


def test_nan_raises_unless_skip_nan():
    r = torch.tensor([1.0, float("nan"), 0.0, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"rewards must not contain NaN, got rewards\[1\].*skip_nan"):
        ops.group_advantages(r, group_size=3)
    got = ops.group_advantages(r, group_size=3, skip_nan=True)
    # The NaN row leaves the statistics: group 0 is {1, 0}; it gets 0 itself.
    want = ref.group_advantages(r, group_size=3, skip_nan=True)
    torch.testing.assert_close(got, want)
    assert got[1] == 0 and torch.isfinite(got).all()
    s = 0.5**0.5
    torch.testing.assert_close(got[[0, 2]], torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6)]))


def test_inf_always_raises():
    r = torch.tensor([1.0, float("-inf"), 0.0])
    for skip in (False, True):
        with pytest.raises(ValueError, match=r"rewards must be finite, got rewards\[1\] = -inf"):
            ops.group_advantages(r, group_size=3, skip_nan=skip)


# ---- argument errors name the argument ----------------------------------------------------------------------


def test_argument_errors():
    r = torch.zeros(4)
    with pytest.raises(ValueError, match=r"rewards must be 1-D \(N,\), got shape \(2, 2\)"):
        ops.group_advantages(r.view(2, 2), group_size=2)
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
        ops.group_advantages(r, [1, 4])
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, got offsets\[1\] = 3 > offsets\[2\] = 2"):
        ops.group_advantages(r, [0, 3, 2, 4])
    with pytest.raises(ValueError, match=r"must equal the number of rewards N = 4, got 3"):
        ops.group_advantages(r, [0, 2, 3])
    with pytest.raises(ValueError, match="offsets must be an int64 tensor"):
        ops.group_advantages(r, torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match=r"offsets must be 1-D \(G \+ 1,\)"):
        torch.ops.oar.group_advantages(r, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"offsets must have dtype in \{Long\}, got Int"):
        torch.ops.oar.group_advantages(r, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must have G \\+ 1 >= 1 entries"):
        torch.ops.oar.group_advantages(r, torch.empty(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r'estimator must be one of \{"grpo", "dr_grpo", "batch", "rloo"\}, got "ppo"'):
        ops.group_advantages(r, group_size=2, estimator="ppo")
    with pytest.raises(ValueError, match='std must be one of .*got "population"'):
        ops.group_advantages(r, group_size=2, std="population")
    with pytest.raises(ValueError, match='singleton must be one of .*got "one"'):
        ops.group_advantages(r, group_size=2, singleton="one")
    with pytest.raises(ValueError, match="eps must be finite and >= 0, got -0.1"):
        ops.group_advantages(r, group_size=2, eps=-0.1)
    with pytest.raises(ValueError, match="preset must be one of"):
        ops.group_advantages(r, group_size=2, preset="deepspeed")
    with pytest.raises(ValueError, match="rewards must be real"):
        torch.ops.oar.group_advantages(r.to(torch.complex64), torch.tensor([0, 4]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    with pytest.raises((ValueError, RuntimeError, NotImplementedError), match="offsets|CUDA|cuda"):
        torch.ops.oar.group_advantages(torch.zeros(4), torch.tensor([0, 4], device="cuda"))


# ---- singleton warning --------------------------------------------------------------------------------------


def test_all_singletons_warn():
    r = torch.tensor([1.0, 0.0, 1.0])
    with pytest.warns(UserWarning, match="every group has a single response"):
        out = ops.group_advantages(r, group_size=1)
    assert torch.equal(out, torch.zeros(3))
    # Empty groups and NaN-only rows do not hide the condition.
    with pytest.warns(UserWarning, match="single response"):
        ops.group_advantages(torch.tensor([1.0, float("nan"), 0.0]), [0, 2, 2, 3], skip_nan=True)


def test_no_warning_for_verl_or_real_groups():
    r = torch.tensor([1.0, 0.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.group_advantages(r, group_size=1, preset="verl")
        ops.group_advantages(r, [0, 1, 3])
        ops.group_advantages(torch.empty(0), [0])


# ---- presets vs each trainer's formula, written out independently ----------------------------------------------


def test_preset_table():
    assert ops.ADVANTAGE_PRESETS is groups.ADVANTAGE_PRESETS  # defined in oar.groups, re-exported by oar.ops
    assert ops.ADVANTAGE_PRESETS["trl"] == {"std": "unbiased", "eps": 1e-4, "singleton": "zero"}
    assert ops.ADVANTAGE_PRESETS["verl"] == {"std": "unbiased", "eps": 1e-6, "singleton": "verl"}
    assert ops.ADVANTAGE_PRESETS["openrlhf"] == {"std": "unbiased", "eps": 1e-9, "singleton": "zero"}
    assert ops.ADVANTAGE_PRESETS["default"] == {"std": "unbiased", "eps": 1e-6, "singleton": "zero"}


def test_explicit_arguments_override_preset():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    got = ops.group_advantages(r, group_size=2, preset="trl", eps=0.5, std="biased")
    # biased std of {1, 0} is 0.5, of {3, 1} is 1: (r - mean) / (std + 0.5)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, 1 / 1.5, -1 / 1.5]))


@pytest.mark.parametrize("scale_rewards,estimator", [("group", "grpo"), ("batch", "batch"), ("none", "dr_grpo")])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_trl_preset(scale_rewards, estimator, kind):
    G = 8
    r = rewards_for(6 * G, seed=11, kind=kind)
    r[:G] = 1.0  # one solved group: TRL gives (1 - 1) / (0 + 1e-4) = 0 exactly
    want = trl_advantages(r, G, scale_rewards)
    got = ops.group_advantages(r, group_size=G, preset="trl", estimator=estimator)
    # The op accumulates in float64 and rounds once: TRL's formula in float64, rounded (rule 1)
    assert_close_to_rounded(got, trl_advantages(r.double(), G, scale_rewards))
    assert want.dtype == torch.float32


def verl_grpo(scores, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl core_algos.compute_grpo_outcome_advantage on sequence scores (float32, as verl runs it)."""
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(vals)
            id2mean[idx], id2std[idx] = t.mean(), t.std()
    out = scores.clone()
    for i in range(len(scores)):
        if norm_adv_by_std_in_grpo:
            out[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            out[i] = scores[i] - id2mean[index[i]]
    return out


def verl_rloo(scores, index):
    """verl compute_rloo_outcome_advantage: n/(n-1) (r - mean) for n > 1, the reward itself for n = 1."""
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    out = scores.clone()
    for i in range(len(scores)):
        vals = id2score[index[i]]
        n = len(vals)
        if n > 1:
            mean = torch.stack(vals).mean()
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_verl_preset_grpo(norm_by_std):
    sizes = [5, 1, 4, 1, 7, 3]  # includes singleton groups: verl's mean 0 / std 1 quirk
    index = [f"uid-{g}" for g, s in enumerate(sizes) for _ in range(s)]
    r = rewards_for(len(index), seed=4, kind="normal")
    want = verl_grpo(r, index, norm_adv_by_std_in_grpo=norm_by_std)
    got = ops.group_advantages(r, group_ids=index, preset="verl", estimator="grpo" if norm_by_std else "dr_grpo")
    assert_close_to_rounded(got, verl_grpo(r.double(), index, norm_adv_by_std_in_grpo=norm_by_std))  # float64, rounded
    assert want.dtype == torch.float32
    # singleton rows: r / (1 + eps) or r, computed in float64 and rounded once
    single = [sum(sizes[:1]), sum(sizes[:3])]
    assert_close_to_rounded(got[single], r[single].double() / (1 + 1e-6) if norm_by_std else r[single].double())


def test_verl_preset_rloo():
    sizes = [4, 1, 6]
    index = [g for g, s in enumerate(sizes) for _ in range(s)]
    r = rewards_for(len(index), seed=9, kind="normal")
    got = ops.group_advantages(r, group_ids=index, preset="verl", estimator="rloo")
    assert_close_to_rounded(got, verl_rloo(r.double(), index))  # rule 1: verl's formula in float64, rounded once


def openrlhf(rewards, n, estimator):
    """OpenRLHF experience_maker: rewards.reshape(-1, n_samples_per_prompt), then per estimator."""
    x = rewards.reshape(-1, n)
    if estimator == "group_norm":
        x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-9)
    elif estimator == "rloo":
        baseline = (x.sum(-1, keepdim=True) - x) / (n - 1)
        x = x - baseline
    elif estimator == "dr_grpo":
        x = x - x.mean(-1, keepdim=True)
    return x.reshape(-1)


@pytest.mark.parametrize("theirs,ours", [("group_norm", "grpo"), ("rloo", "rloo"), ("dr_grpo", "dr_grpo")])
def test_openrlhf_preset(theirs, ours):
    n = 4
    r = rewards_for(5 * n, seed=13, kind="normal").double()
    want = openrlhf(r, n, theirs)
    got = ops.group_advantages(r, group_size=n, preset="openrlhf", estimator=ours)
    assert_close_to_rounded(got, want)  # OpenRLHF's formula in float64 here


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_openrlhf_singleton_quirk_gives_zero_not_nan():
    r = torch.tensor([1.0, 0.0, 1.0])
    # OpenRLHF itself: std of one value is NaN (group_norm), rloo divides by n - 1 = 0.
    assert torch.isnan(openrlhf(r, 1, "group_norm")).all()
    assert not torch.isfinite(openrlhf(r, 1, "rloo")).all()
    for est in ("grpo", "rloo"):
        with pytest.warns(UserWarning, match="single response"):
            out = ops.group_advantages(r, group_size=1, preset="openrlhf", estimator=est)
        assert torch.equal(out, torch.zeros(3))


# ---- properties ------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    estimator=st.sampled_from(ESTIMATORS),
    shift=st.floats(-100, 100),
)
def test_property_group_sums_and_shift_invariance(sizes, seed, estimator, shift):
    off = ragged_offsets(sizes)
    r = rewards_for(int(off[-1]), seed=seed, kind="normal").double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = ops.group_advantages(r, off, estimator=estimator)
        b = ops.group_advantages(r + shift, off, estimator=estimator)
    assert torch.isfinite(a).all()
    if r.numel() == 0:
        return
    # a and b are float64 statistics rounded once to float32 (half an ulp each). In float64 the shift moves the
    # centred rewards by gamma_{n+4} (|shift| + max|r|), twice that over the smallest std (< 1) in output units.
    stds = [float(r[off[g]:off[g + 1]].std()) for g in range(len(sizes)) if sizes[g] > 1]
    stds += [float(r.std())] if r.numel() > 1 else []  # one reward has no std (torch warns, gives NaN)
    f64 = 2 * gamma(max(sizes) + 4, torch.float64) * (abs(shift) + float(r.abs().max()))
    f64 /= min([1.0] + [v for v in stds if v > 0])
    assert_within(a, b, ulp(torch.maximum(a.abs(), b.abs())) + f64, "shift invariance")
    for g in range(len(sizes)):
        seg = a[off[g] : off[g + 1]].double()
        # Every estimator sums to 0 over a group: what is left is the float32 rounding of each term (u |a_i|),
        # the float64 errors of the terms and the float64 sum here.
        bound = (2.0**-24 + gamma(max(seg.numel(), 1), torch.float64)) * float(seg.abs().sum()) + seg.numel() * f64
        assert abs(float(seg.sum())) <= bound, (g, float(seg.sum()), bound)


# ---- opcheck ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((torch.randn(13), torch.tensor([0, 3, 3, 10, 13])), {}),
        ((torch.randn(8, dtype=torch.float64), torch.tensor([0, 4, 8])), {"estimator": "rloo", "std": "biased"}),
        ((torch.tensor([1.0, float("nan"), 0.0, 2.0]), torch.tensor([0, 4])), {"skip_nan": True, "eps": 1e-4}),
        ((torch.randint(0, 2, (6,)), torch.tensor([0, 1, 6])), {"singleton": "verl", "estimator": "batch"}),
    ],
)
def test_opcheck(args, kwargs):
    torch.library.opcheck(torch.ops.oar.group_advantages.default, args, kwargs)


def test_opcheck_requires_grad_and_no_autograd():
    r = torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.oar.group_advantages.default, (r, torch.tensor([0, 3, 6])))
    out = ops.group_advantages(r, group_size=3)
    assert not out.requires_grad and out.grad_fn is None


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------


def ragged_case(seed, dtype):
    """Rewards over ragged groups: empty groups, singletons, all-equal groups, regular groups."""
    g = gen(seed)
    sizes = [4, 0, 1, 7, 3, 16, 2, 0, 33, 5, 1, 64]
    n = sum(sizes)
    r = torch.randn(n, generator=g, dtype=torch.float64)
    off = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int64)
    r[off[4]:off[5]] = 0.75  # an all-equal group (exactly 0 whatever the estimator)
    r[off[8]:off[8] + 10] = torch.randint(0, 2, (10,), generator=g).double()  # ties
    return r.to(dtype), off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("preset", ["default", "trl", "verl", "openrlhf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool], ids=str)
def test_group_advantages_parity_ragged(device, estimator, preset, dtype):
    r, off = ragged_case(3, torch.float64)
    r = (r > 0) if dtype == torch.bool else (r * 4).round().to(dtype) if dtype == torch.int64 else r.to(dtype)
    cpu = ops.group_advantages(r, off, estimator=estimator, preset=preset)
    dev = ops.group_advantages(on(r, device), on(off, device), estimator=estimator, preset=preset)
    assert dev.device.type == device and dev.dtype == torch.float32 and dev.shape == cpu.shape
    torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-6, atol=2e-6)
    # Against the float64 reference of the same values (exact in float64 whatever the dtype).
    torch.testing.assert_close(dev.cpu(), ref.group_advantages(r, off, estimator=estimator, preset=preset),
                               rtol=1e-5, atol=1e-5)
    # All-equal groups and singletons (except verl's) are exactly 0 on both.
    assert torch.equal(dev.cpu()[off[4]:off[5]], torch.zeros(int(off[5] - off[4])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:oar.group_advantages. every group has a single response")
@pytest.mark.parametrize("n, G", [(4096, 512), (4096, 4), (100_000, 10), (1, 1), (0, 0), (0, 3), (257, 1)])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_advantages_parity_sizes(device, n, G, estimator):
    # (4096, 4) and (100000, 10) take the block-per-group path of the CUDA kernel (>= 256 rewards per group), the
    # others the warp-per-group path; (0, 0) is offsets == [0].
    g = gen(n + G)
    r = torch.rand(n, generator=g) * 10
    if G == 0:
        off = torch.zeros(1, dtype=torch.int64)
    else:
        cuts = torch.sort(torch.randint(0, n + 1, (G - 1,), generator=g)).values
        off = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([n])])
    cpu = ops.group_advantages(r, off, estimator=estimator, preset="trl")
    dev = ops.group_advantages(on(r, device), on(off, device), estimator=estimator, preset="trl")
    torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-6, atol=2e-6)
    if n <= 4096:  # the reference loops in Python: the big case would take seconds
        torch.testing.assert_close(dev.cpu(), ref.group_advantages(r, off, estimator=estimator, preset="trl"),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_advantages_skip_nan_parity(device, estimator):
    r, off = ragged_case(5, torch.float32)
    r[[0, 9, 40, 41]] = float("nan")
    cpu = ops.group_advantages(r, off, estimator=estimator, skip_nan=True)
    dev = ops.group_advantages(on(r, device), on(off, device), estimator=estimator, skip_nan=True)
    torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dev.cpu(), ref.group_advantages(r, off, estimator=estimator, skip_nan=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_group_advantages_large_magnitude_all_equal_is_exactly_zero(device):
    r = torch.full((64,), 1e30, dtype=torch.float64)
    out = ops.group_advantages(on(r, device), group_size=8)
    assert torch.equal(out.cpu(), torch.zeros(64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["interleaved", "shuffled"])
def test_group_ids_tensor_on_the_device(device, layout):
    # Ids as a tensor on the rewards' device (grouped there with torch ops), or on another device than the rewards.
    ids = layouts([4, 1, 7, 3, 2, 5], seed=9)[layout]
    r = rewards_for(len(ids), seed=13, kind="normal")
    want = ops.group_advantages(r, group_ids=ids)
    torch.testing.assert_close(want, per_group_loop(r, ids), rtol=1e-5, atol=1e-6)
    got = ops.group_advantages(on(r, device), group_ids=on(torch.tensor(ids), device))
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ops.group_advantages(r, group_ids=on(torch.tensor(ids), device)), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"rewards must not contain NaN, got rewards\[5\]"):
        ops.group_advantages(on(r.index_fill(0, torch.tensor([5]), float("nan")), device),
                             group_ids=on(torch.tensor(ids), device))


def _opcheck_cases():
    g = gen(0)
    r = torch.randn(10, generator=g)
    off = torch.tensor([0, 3, 3, 10])
    return {
        "group_advantages": ((r, off), {}),
        "group_advantages_batch": ((r, off), {"estimator": "batch"}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck_on_device(device, case):
    args, kwargs = _opcheck_cases()[case]
    torch.library.opcheck(torch.ops.oar.group_advantages.default, tuple(on(a, device) for a in args), kwargs)


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_offsets_on_another_device_are_refused(device):
    with pytest.raises(ValueError, match=r"offsets must be on the same device as rewards"):
        torch.ops.oar.group_advantages(torch.randn(6, device=device), torch.tensor([0, 3, 6]))


# ---- bad input: one table ----------------------------------------------------------------------------------------
# Each row: (the callable: the wrapper or the raw op, its keyword arguments, the exception, a regex of the message).
# Tensors are moved to the device under test; meta tensors stay on meta.

R = torch.tensor([1.0, 0.0, 1.0, 0.0])
R6 = torch.randn(6, generator=gen(71))
OFF6 = torch.tensor([0, 3, 6])
GA, RAW = ops.group_advantages, torch.ops.oar.group_advantages

#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(GA, dict(rewards=R6, offsets=OFF6.float()), ValueError, r"offsets must be an int64 tensor",
                 id="offsets_dtype"),
    pytest.param(GA, dict(rewards=R6.index_fill(0, torch.tensor([4]), float("nan")), offsets=OFF6), ValueError,
                 r"rewards must not contain NaN, got rewards\[4\]", id="nan_reward"),
    pytest.param(GA, dict(rewards=torch.tensor([1.0, float("inf")]), group_size=2), ValueError,
                 r"rewards must be finite, got rewards\[1\] = inf", id="inf_reward"),
    pytest.param(GA, dict(rewards=R6, offsets=torch.tensor([0, 4, 3, 6])), ValueError,
                 r"offsets must be non-decreasing", id="bad_offsets"),
    pytest.param(GA, dict(rewards=R6, offsets=torch.tensor([0, 3, 5])), ValueError, r"offsets\[-1\]",
                 id="offsets_end"),
    pytest.param(GA, dict(rewards=R6, offsets=torch.tensor([0, 3])), ValueError, r"offsets", id="offsets_short"),
]

#: Checks of the Python wrapper's arguments and of the fake (meta) kernel, and float64 edge cases of the CPU kernel.
BAD_INPUT_CPU = [
    # Finite float64 rewards whose squared deviations overflow double used to give A = 0 silently.
    pytest.param(GA, dict(rewards=torch.tensor([1.7e308, -1.7e308, 1.0, 0.0], dtype=torch.float64), group_size=2),
                 ValueError, r"statistics of group 0 overflow double .*rescale the rewards", id="group_overflow"),
    pytest.param(GA, dict(rewards=torch.tensor([1.7e308, -1.7e308, 1.0, 0.0], dtype=torch.float64), group_size=2,
                          estimator="batch"), ValueError, r"statistics of the batch overflow double",
                 id="batch_overflow"),
    pytest.param(GA, dict(rewards=R, group_size=2, estimator=None), ValueError,
                 r"estimator must be a str, got NoneType None", id="estimator_none"),
    pytest.param(GA, dict(rewards=R, group_size=2, estimator=3), ValueError, r"estimator must be a str, got int 3",
                 id="estimator_int"),
    pytest.param(GA, dict(rewards=R, group_size=2, std=1), ValueError, r"std must be a str, got int 1", id="std_int"),
    pytest.param(GA, dict(rewards=R, group_size=2, singleton=0), ValueError, r"singleton must be a str, got int 0",
                 id="singleton_int"),
    pytest.param(GA, dict(rewards=R, group_size=2, preset=["trl"]), ValueError,
                 r"preset must be one of .* or None, got \['trl'\]", id="preset_list"),
    pytest.param(GA, dict(rewards=R, group_size=2, eps="1e-4"), ValueError,
                 r"eps must be a real number, got str '1e-4'", id="eps_str"),
    pytest.param(GA, dict(rewards=R, group_size=2, eps=None, preset="nope"), ValueError, r"preset must be one of",
                 id="preset_unknown"),
    pytest.param(GA, dict(rewards=R, group_size=2, skip_nan="no"), ValueError,
                 r"skip_nan must be True or False, got str 'no'", id="skip_nan_str"),
    pytest.param(GA, dict(rewards=R, group_size=2, skip_nan=torch.tensor(True)), ValueError,
                 r"skip_nan must be True or False, got Tensor", id="skip_nan_tensor"),
    pytest.param(GA, dict(rewards=R, offsets=[]), ValueError,
                 r"offsets must have G \+ 1 >= 1 entries .*got shape \(0,\)", id="offsets_empty"),
    pytest.param(GA, dict(rewards=R, offsets=[0, 2**64, 4]), ValueError,
                 r"offsets must be a sequence of int64 CSR row starts", id="offsets_overflow"),
    pytest.param(GA, dict(rewards=R, offsets=torch.tensor([0, 2, 4], device="meta")), ValueError,
                 r"offsets must hold data .*got a meta tensor", id="offsets_meta"),
    pytest.param(GA, dict(rewards=R, group_ids=[[0], [0], [1], [1]]), ValueError,
                 r"group_ids must hold hashable ids .*got \[0\] at row 0", id="group_ids_unhashable"),
    pytest.param(GA, dict(rewards=R, group_ids="aabb"), ValueError,
                 r"group_ids must be a sequence with one id per reward, got str", id="group_ids_str"),
    pytest.param(GA, dict(rewards=R, group_ids=torch.zeros(4, dtype=torch.long, device="meta")), ValueError,
                 r"group_ids must hold data .*got a meta tensor", id="group_ids_meta"),
    pytest.param(GA, dict(rewards=R, group_ids=torch.zeros(2, 2, dtype=torch.long)), ValueError,
                 r"group_ids must be 1-D \(N,\), got shape \(2, 2\)", id="group_ids_2d"),
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(RAW, dict(rewards=R, offsets=None), ValueError, r"offsets must be a tensor, got None",
                 id="raw_offsets_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(RAW, dict(rewards=torch.empty(4, device="meta"), offsets=torch.tensor([0, 2, 4])), ValueError,
                 r"offsets must be on the same device as rewards \(meta\), got cpu", id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


def test_group_advantages_meta_tensor_gives_shape_only():
    # The single-response warning used to call .item() on meta data (RuntimeError).
    out = ops.group_advantages(torch.empty(4, device="meta"), group_size=2)
    assert out.device.type == "meta" and out.shape == (4,) and out.dtype == torch.float32


# ---- torch.compile of the wrapper ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.group_advantages traces into one graph (offsets / group_size / presets / Python scalars coerced at
    trace time; the single-response warning, a data read, is skipped under compile) and gives the eager values."""
    torch._dynamo.reset()
    r = rewards_for(12, seed=8, kind="normal")
    off = torch.tensor([0, 5, 5, 12])

    def f(r, off):
        a = ops.group_advantages(r, off, estimator="rloo", preset="trl", eps=0.5)
        b = ops.group_advantages(r, group_size=4, preset="verl", skip_nan=True)
        c = ops.group_advantages(r, group_size=1)  # all singletons: the eager wrapper warns here
        return a, b, c

    with pytest.warns(UserWarning, match="single response"):
        eager = f(r, off)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(f, backend=backend, fullgraph=True)(r, off)
    assert not [w for w in caught if "single response" in str(w.message)]  # not emitted under compile (documented)
    for e, c in zip(eager, compiled):
        assert torch.equal(c, e)
