"""OAR scores on verl 0.9.1's real actor workers under verl's default settings, as far as verl runs on CPU.

tests/python/integrations/test_verl_workers.py runs verl's ``ActorRolloutRefWorker`` with the FSDP2 engine in
float32, eager attention, no remove-padding, offload or gradient checkpointing. verl's defaults are FSDP1 (``actor.strategy=fsdp``)
with bf16 mixed precision and flash-attention. This file runs, on the same 2 gloo ranks, tiny model and rows
(``verl_worker.variants_main``, one worker group per setting of ``verl_worker.VARIANTS``):

* ``fsdp2_offload_ckpt``: ``fsdp_config.param_offload=True`` and ``model.enable_gradient_checkpointing=True``
  (float32): the workers' oar_g / oar_p scores within the float32 error model of the single-process pipeline.
* ``remove_padding``: ``model.use_remove_padding=True`` (float32): same check, and verl's own log-probs.
* ``fsdp2_bf16``: verl's default mixed precision (``param_dtype=bf16``): the forwards run in bf16 (seen at the
  ``lm_head``), and the scores are as close to the float64 truth as the single process's under the same bf16
  compute (parameters in bf16, buffers in float32) is, within twice its error (_tolerance.py's rule for bf16).
* ``fsdp1``: FSDP1 does not build on CPU (torch's FSDP1 ``sync_module_states=True``, which verl always sets, needs
  the parameters on a GPU): the test pins verl's error, so that no score is ever produced on that path here.

Flash-attention (verl's ``attn_implementation=flash_attention_2``) needs the CUDA flash_attn package: not run
here (benchmarks/gpu/run_verl_defaults.sh runs it on a GPU). docs/trainers/verl.md, "What the CPU tests run".
"""

import copy
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="verl not installed (pip install -r requirements/trainers.txt)")
pytest.importorskip("transfer_queue", reason="TransferQueue not installed (requirements/trainers-nodeps.txt)")

import oar  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402
from oar.integrations import verl as oar_verl  # noqa: E402

oar_verl.register()
from oar.integrations.verl import dispatch  # noqa: E402
from oar.pipeline import Pipeline  # noqa: E402

from _error_model import pipeline_scores_estimate  # noqa: E402
from _paths import WORKERS  # noqa: E402
from _tolerance import assert_close_to_reference, assert_within_error_model, ulp  # noqa: E402

sys.path.insert(0, str(WORKERS))  # verl_worker's rollouts and data_proto are imported too
FLOAT32 = ["fsdp2_offload_ckpt", "remove_padding"]
BF16 = ["fsdp2_bf16"]
REFUSED = ["fsdp1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_defaults")
    from _subproc import child_env

    p = subprocess.run([sys.executable, str(WORKERS / "verl_worker.py"), str(out),
                        "--variants", ",".join(REFUSED + FLOAT32 + BF16)],
                       capture_output=True, text=True, timeout=1200, env=child_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return torch.load(out / "variants.pt", weights_only=False)


@pytest.fixture(scope="module")
def tiny():
    import _verl_cpu

    return tiny_random_llama(**_verl_cpu.TINY)


def _bf16_compute(model):
    """The single-process model under verl's bf16 mixed precision: parameters rounded to bf16 (FSDP's
    ``param_dtype``), buffers (the rotary ``inv_freq``) left in float32 (FSDP2 leaves buffers alone; verl's
    ``buffer_dtype`` is fp32)."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    return m


def _chunks(run, tok, r):
    """The per-rank chunks the workers scored (2 rows on rank 0, 1 row + padding on rank 1), the config they ran
    with (memory budget as the workers capped it) and the workers' scores placed in request order."""
    import verl_worker

    rows = oar_verl.rollout_rows(verl_worker.data_proto(run["rows"]), oar.OARConfig(method="oar_g"))
    cfg = oar.OARConfig.from_json(json.dumps(dict(json.loads(r["config"]), memory_budget_mb=r["memory_budget_mb"])))
    req, active = dispatch.scores_request(rows, cfg, r["seq"], 2)
    assert req.batch_size[0] == 4 and len(active) == 3
    got = torch.zeros((4,) + tuple(rows["responses"].shape[1:]))
    got[:3] = r["scores"][active]
    out = []
    for k, n in ((0, 2), (1, 1)):
        batch = dispatch.request_batch(req[2 * k: 2 * k + 2])
        out.append((k, n, batch, got[2 * k: 2 * k + n], active[2 * k: 2 * k + n]))
    inactive = [i for i in range(len(r["seq"])) if i not in active]
    assert not r["reasoning_mask"][inactive].any() and (r["scores"][inactive] == 0).all()
    return cfg, out


def _check_ranks(v, method, dtype):
    ranks = v["scores"][method]["ranks"]
    assert len(ranks) == 2 and ranks[0]["forwards"] == ranks[1]["forwards"] > 0  # the forward gate: in step
    assert all(x["no_grads"] for x in ranks)
    assert all(x["lm_head_dtypes"] == [str(dtype)] for x in ranks), ranks


def test_settings_took_effect(run):
    """Each setting reached verl's engine: parameter offload and gradient checkpointing are on in the engine and
    the module, FSDP2 wraps the policy, and no setting that should run raised."""
    for name in FLOAT32 + BF16:
        v = run["variants"][name]
        assert "error" not in v, (name, v.get("error"))
        ranks = v["scores"]["oar_g"]["ranks"]
        assert all(x["fsdp2"].startswith("FSDP") for x in ranks)
        want = name == "fsdp2_offload_ckpt"
        assert all(x["param_offload"] is want and x["gradient_checkpointing"] is want for x in ranks), (name, ranks)


def check_float32_scores(run, model, tok, name, method):
    """float32 setting ``name``: each rank's ``method`` scores are within the float32 error model (rule 1 of
    _tolerance.py) of the float64 pipeline on its chunk, as the single-process pipeline's are; the reasoning masks
    are equal; both ranks ran the same number of policy forwards, in float32. Also used by test_install.py on the
    workers of the install venv (transformers 5.10.4)."""
    v = run["variants"][name]
    assert "error" not in v, v.get("error")
    _check_ranks(v, method, torch.float32)
    r = v["scores"][method]
    cfg, chunks = _chunks(run, tok, r)
    for k, n, batch, got, rows in chunks:
        alone = Pipeline(cfg, tok).scores(batch, model)
        exact = pipeline_scores_estimate(cfg, tok, batch, model)
        assert alone.reasoning_mask[:n].any()
        assert torch.equal(r["reasoning_mask"][rows], alone.reasoning_mask[:n])
        assert_within_error_model(got, exact[:n], what=f"{name} {method} rank {k}")
        assert_within_error_model(alone.scores[:n], exact[:n], what=f"{name} {method} alone {k}")


@pytest.mark.parametrize("name", FLOAT32)
@pytest.mark.parametrize("method", ["oar_g", "oar_p"])
def test_float32_scores_equal_the_single_process_pipeline(run, tiny, name, method):
    """float32 settings: :func:`check_float32_scores`."""
    model, tok = tiny
    check_float32_scores(run, model, tok, name, method)


@pytest.mark.parametrize("name", BF16)
@pytest.mark.parametrize("method", ["oar_g", "oar_p"])
def test_bf16_scores_as_close_as_the_single_process_under_bf16(run, tiny, name, method):
    """verl's default mixed precision (bf16 compute over float32 weights): the lm_head ran in bf16 on both ranks,
    in step; each rank's scores are within twice the single process's own bf16 error of the float64 truth (plus
    one bf16 ulp of the largest score), and that budget is not vacuous (below a quarter of the largest score)."""
    model, tok = tiny
    v = run["variants"][name]
    assert "error" not in v, v.get("error")
    _check_ranks(v, method, torch.bfloat16)
    r = v["scores"][method]
    cfg, chunks = _chunks(run, tok, r)
    m16 = _bf16_compute(model)
    for k, n, batch, got, rows in chunks:
        alone = Pipeline(cfg, tok).scores(batch, m16)
        exact = pipeline_scores_estimate(cfg, tok, batch, model).value[:n]
        assert alone.reasoning_mask[:n].any()
        assert torch.equal(r["reasoning_mask"][rows], alone.reasoning_mask[:n])
        ref_err = float((alone.scores[:n].double() - exact).abs().max())
        assert 2 * ref_err < 0.25 * float(exact.abs().max()), (ref_err, float(exact.abs().max()))
        # rule for bf16 (_tolerance.py): |worker - truth| <= 2 |single process in bf16 - truth| + one bf16 ulp
        atol = float(ulp(float(exact.abs().max()), torch.bfloat16))
        assert_close_to_reference(got, exact, alone.scores[:n], atol=atol, what=f"{name} {method} rank {k}")


def test_remove_padding_log_probs_equal_a_float32_forward(run, tiny):
    """verl's own ``compute_log_prob`` with ``use_remove_padding=True`` (sequences packed without padding) equals
    a float32 HF forward of each row alone (the same bound as test_verl_workers.py's float32 check)."""
    model, _ = tiny
    v = run["variants"]["remove_padding"]
    for i, row in enumerate(run["rows"]):
        ids = torch.cat([row["prompt"], row["response"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
        q = len(row["response"])
        want = logp[len(row["prompt"]) - 1: len(ids) - 1].gather(1, row["response"][:, None])[:, 0]
        torch.testing.assert_close(v["log_probs"][i, :q].double(), want, rtol=0, atol=1e-4)


def test_fsdp1_does_not_build_on_cpu(run):
    """verl's FSDP1 engine (``actor.strategy=fsdp``, verl's default) fails in ``init_model`` on CPU: verl builds
    ``FSDP(..., sync_module_states=True, device_id=get_device_id())`` (verl/workers/engine/fsdp/transformer_impl.py,
    ``_build_fsdp_module``), and torch's FSDP1 refuses to sync CPU parameters. No score is produced on that path:
    the failure is verl's own, at start, before any rollout."""
    v = run["variants"]["fsdp1"]
    assert v["overrides"]["actor.strategy"] == "fsdp"
    err = v.get("error")
    assert err is not None and "ValueError" in err["type"], err
    assert "has CPU parameters or buffers when `sync_module_states=True`" in err["message"], err["message"]
    assert "in _build_fsdp_module" in err["message"] and "init_model" not in v["times"]
    assert v["scores"] == {}
