"""oar's OpenRLHF patch against the REAL openrlhf 0.11.2 ``RemoteExperienceMaker.compute_advantages_and_returns``
(run in a subprocess, tests/python/openrlhf_worker.py, because its module imports GPU-only packages that
get stand-ins there), plus the launcher's Ray runtime-env injection.

Skipped when openrlhf is not installed.
"""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("ray")
if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("openrlhf not installed (pip install --no-deps openrlhf==0.11.2)", allow_module_level=True)

from oar import baselines, ops  # noqa: E402
from _tolerance import assert_close_to_reference, assert_within, gamma, mass_bound, ulp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
N = 4


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("orl") / "res.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "openrlhf_worker.py"), str(out)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _prompt_order(res, per_exp):
    """Concatenate per-experience (N, A_e) tensors into prompt order (2N, A_max)."""
    A = max(t.shape[1] for t in per_exp)
    rows = torch.cat([torch.nn.functional.pad(t, (0, A - t.shape[1])) for t in per_exp])
    pos = torch.tensor([p for x in res["inputs"] for p in x["index"]])
    return rows[torch.argsort(pos)]


def _inputs(res):
    mask = _prompt_order(res, [x["action_mask"] for x in res["inputs"]]).bool()
    ids = _prompt_order(res, [x["sequences"][:, -x["action_mask"].shape[1]:] for x in res["inputs"]])
    rewards = torch.cat([x["rewards"] for x in res["inputs"]])[torch.argsort(
        torch.tensor([p for x in res["inputs"] for p in x["index"]]))]
    return ids, mask, rewards


def test_patches_the_supported_signature(res):
    assert res["signature"] == ["self", "experiences"]


def test_grpo_is_openrlhf_unchanged(res):
    # method grpo / dr_grpo keeps OpenRLHF's own advantages: the per-response value times the mask, exactly
    for method, est in (("grpo", "group_norm"), ("dr_grpo", "dr_grpo")):
        for ours, theirs in zip(res[method], res[f"original/{est}"]):
            torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    for ours, theirs in zip(res["hook_grpo"], res["original/group_norm"]):
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert res["restored"] and res["hook_installed"]


def test_openrlhf_sequence_advantages_are_group_norm(res):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]  # OpenRLHF's float32 group_norm: the yardstick
    r = rewards.double().view(-1, N)  # its formula in float64: (r - mean) / (std + 1e-9), unbiased std
    ref64 = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-9)).flatten()
    assert_close_to_reference(ops.group_advantages(rewards, group_size=N, preset="openrlhf"), ref64, seq,
                              what="oar openrlhf preset vs OpenRLHF")


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "random", "entropy"])
def test_reshaping_methods_keep_mass(res, method):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]
    tok = _prompt_order(res, res[method])
    L = mask.sum(1)  # + the adapter's read of A as the float32 mean of the response's equal values
    assert_within(tok.sum(1), seq * L, mass_bound(seq, L) + gamma(int(L.max()) + 1) * seq.abs().double() * L, "mass")
    assert (tok[~mask] == 0).all()
    assert not torch.allclose(tok, seq[:, None] * mask, atol=1e-4)


def test_additive_baselines(res):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]
    bonus = baselines.ktae_token_scores(ids, mask, rewards, group_size=N, ignore_ids=sorted({res["eos"], res["pad"]}))
    # the adapter reads A as the float32 mean of the response's (equal) values: within gamma_L |A| of seq
    L = mask.sum(1, keepdim=True)
    want = (seq[:, None] + bonus) * mask
    bound = (gamma(int(L.max()) + 1) * seq.abs()[:, None] + ulp(want)) * mask
    assert_within(_prompt_order(res, res["ktae"]), want, bound, "ktae advantages")
    es = _prompt_order(res, res["entropy_shaping"])
    b = (es - seq[:, None]) * mask
    slack = ulp(es).float() + gamma(int(L.max()) + 1) * seq.abs()[:, None]  # A + bonus rounded once; A read as a mean
    assert (b >= -slack).all() and (b <= seq.abs()[:, None] / 2 + slack).all() and b.abs().sum() > 0


def test_refusals_are_clear(res):
    e = res["errors"]
    assert "--algo.kl.use_loss" in e["kl_in_reward"]
    assert "estimator must be one of" in e["gae"] and "'gae'" in e["gae"]
    assert "dr_grpo" in e["dr_grpo_needs_estimator"]
    assert "model=" in e["no_model"]


def test_launcher_injects_the_worker_setup_hook():
    from oar.integrations.openrlhf import _patched_ray_init

    seen = {}
    fake = types.SimpleNamespace(init=lambda *a, **k: seen.update(k))
    fake.init = _patched_ray_init(fake, '{"method": "ktae"}')
    fake.init(runtime_env={"env_vars": {"A": "1"}})
    env = seen["runtime_env"]
    assert env["worker_process_setup_hook"] == "oar.integrations.openrlhf.worker_setup_hook"
    assert env["env_vars"] == {"A": "1", "OAR_CONFIG": '{"method": "ktae"}'}
    fake2 = types.SimpleNamespace(init=lambda *a, **k: None)
    fake2.init = _patched_ray_init(fake2, "{}")
    with pytest.raises(RuntimeError, match="worker_process_setup_hook"):
        fake2.init(runtime_env={"worker_process_setup_hook": "other.hook"})
