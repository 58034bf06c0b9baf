"""oar.ops.group_advantages (method.md section 1) against the float64 reference and against each trainer's
own formula, written out independently here (TRL GRPOTrainer, verl compute_grpo_outcome_advantage /
compute_rloo_outcome_advantage, OpenRLHF experience_maker group_norm / rloo / dr_grpo).
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

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
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_biased_std_and_explicit_eps(estimator):
    off = ragged_offsets([4, 3, 6])
    r = rewards_for(13, seed=2, kind="normal")
    got = ops.group_advantages(r, off, estimator=estimator, std="biased", eps=0.0)
    want = ref.group_advantages(r, off, estimator=estimator, std="biased", eps=0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


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
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rewards_computed_in_float32(dtype):
    # Half-precision statistics would be off by ~1e-3 relative; the op reads the values as float32 and
    # accumulates in double, so it matches the float64 reference of the same (rounded) values to 1e-5.
    r = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 10 + 50).to(dtype)
    for est in ESTIMATORS:
        got = ops.group_advantages(r, group_size=16, estimator=est)
        want = ref.group_advantages(r.double(), group_size=16, estimator=est)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_non_contiguous_rewards():
    base = rewards_for(40, seed=5, kind="normal")
    r = base[::2]
    assert not r.is_contiguous()
    want = ops.group_advantages(r.contiguous(), group_size=5)
    torch.testing.assert_close(ops.group_advantages(r, group_size=5), want)
    off = torch.tensor([0, 7, 20, 0, 0])[:3]  # a view as offsets
    torch.testing.assert_close(ops.group_advantages(r, off), ref.group_advantages(r, off), rtol=1e-5, atol=1e-6)


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
    with pytest.raises(ValueError, match="group_ids must keep each group's rows contiguous"):
        ops.group_advantages(r, group_ids=[0, 0, 1, 1, 0, 0])
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
    assert ops.ADVANTAGE_PRESETS["trl"] == {"std": "unbiased", "eps": 1e-4, "singleton": "zero"}
    assert ops.ADVANTAGE_PRESETS["verl"] == {"std": "unbiased", "eps": 1e-6, "singleton": "verl"}
    assert ops.ADVANTAGE_PRESETS["openrlhf"] == {"std": "unbiased", "eps": 1e-9, "singleton": "zero"}
    assert ops.ADVANTAGE_PRESETS["default"] == {"std": "unbiased", "eps": 1e-6, "singleton": "zero"}


def test_explicit_arguments_override_preset():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    got = ops.group_advantages(r, group_size=2, preset="trl", eps=0.5, std="biased")
    # biased std of {1, 0} is 0.5, of {3, 1} is 1: (r - mean) / (std + 0.5)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, 1 / 1.5, -1 / 1.5]))


def trl_advantages(rewards, G, scale_rewards):
    """TRL GRPOTrainer (sum_then_normalize): group mean; std per group / over the batch / none; + 1e-4."""
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(G)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv


@pytest.mark.parametrize("scale_rewards,estimator", [("group", "grpo"), ("batch", "batch"), ("none", "dr_grpo")])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_trl_preset(scale_rewards, estimator, kind):
    G = 8
    r = rewards_for(6 * G, seed=11, kind=kind)
    r[:G] = 1.0  # one solved group: TRL gives (1 - 1) / (0 + 1e-4) = 0 exactly
    want = trl_advantages(r, G, scale_rewards)
    got = ops.group_advantages(r, group_size=G, preset="trl", estimator=estimator)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # singleton rows: r / (1 + eps) or r
    single = [sum(sizes[:1]), sum(sizes[:3])]
    torch.testing.assert_close(got[single], r[single] / (1 + 1e-6) if norm_by_std else r[single])


def test_verl_preset_rloo():
    sizes = [4, 1, 6]
    index = [g for g, s in enumerate(sizes) for _ in range(s)]
    r = rewards_for(len(index), seed=9, kind="normal")
    got = ops.group_advantages(r, group_ids=index, preset="verl", estimator="rloo")
    torch.testing.assert_close(got, verl_rloo(r, index), rtol=1e-5, atol=1e-5)


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
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


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
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for g in range(len(sizes)):
        seg = a[off[g] : off[g + 1]]
        assert abs(float(seg.double().sum())) < 1e-4 * max(1, seg.numel())


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
