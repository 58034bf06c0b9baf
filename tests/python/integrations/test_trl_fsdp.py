"""OARGRPOTrainer under FSDP1, FSDP2 and DeepSpeed ZeRO-3 (when deepspeed is installed: trl_zero3_process.py, with
DeepSpeed's CPU accelerator): 2 processes (accelerate launch, gloo, CPU), the real trl / accelerate / torch FSDP code,
accelerate's FSDP plugin enabled on CPU by the test scaffold ``_cpu_fsdp`` (accelerate offers FSDP on accelerator
devices only; the wrapping and the mixed-precision policy are the ones GPUs get).

TRL's own defaults, as a user launches it: ``GRPOConfig`` with ``gradient_checkpointing`` and ``bf16`` left unset
(trl 1.13: both True). bf16 runs where the CPU runs bfloat16 natively (``oar.app.train.cpu_has_native_bf16``:
AVX-512 kernels and AVX512-BF16 or AMX); elsewhere the worker sets ``bf16=False`` (emulated bfloat16 on CPU is slower
than float32 and torch's CPU attention can fail under it) and the test's id says ``float32-no-native-bf16``.

Per FSDP version and method (oar_g, oar_p), checked on each rank (the worker is ``trl_fsdp_process.py``):
- the defaults took effect: TRL's training forward ran under activation checkpointing and, with bf16, every forward
  (training and attribution) computed in bfloat16 (FSDP1: FSDP's bf16 parameters, buffers and accelerate's autocast;
  FSDP2: FSDP2's bf16 ``param_dtype``; ZeRO-3: DeepSpeed's bf16 parameters); no attribution forward was
  checkpointed (the forward gate's dummy calls run in eval mode, as the real ones: under ZeRO-3 a checkpointed dummy
  re-gathers parameters in its backward, which ended the step in a gloo "collective mismatch");
- TRL's step finishes on both ranks although one rank has nothing to attribute and the other up to four rows;
- both ranks ran the same number of policy forwards during attribution (a rank that ran fewer would leave the
  other's parameter all-gathers waiting);
- the scores equal those of the single-process pipeline on the same batch with the same (unsharded) weights, with
  chunks planned for the same element size (OAR-G's noise is drawn per chunk): float32: rule 1 of ``_tolerance.py``
  (both runs within the random-rounding estimate of the float32 error around the float64 model's scores,
  ``_error_model.py``); bf16: rule 1 for bf16 (``assert_close_to_reference``): within twice the error of the single
  process computing as the version does in bf16 (:data:`BF16_COMPUTE`) from the float64 scores, plus one bf16 ulp of
  the largest score, a budget checked not to be vacuous; the advantages are exact where the scores are.
Before the attribution used the wrapper and forwards on ids only, FSDP1 failed with "'weight' must be 2-D".
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

import copy  # noqa: E402

from oar.testing import tiny_random_llama  # noqa: E402
from oar.app.train import cpu_has_native_bf16  # noqa: E402
from oar.attribution import HFProbeModel  # noqa: E402
from oar.batch import RolloutBatch  # noqa: E402
from oar.pipeline import Pipeline  # noqa: E402

from _error_model import pipeline_scores_estimate  # noqa: E402
from _paths import WORKERS  # noqa: E402
from _subproc import child_env  # noqa: E402
from _tolerance import assert_close_to_reference, assert_within_error_model, float64_model, ulp  # noqa: E402

sys.path.insert(0, str(WORKERS))
import trl_fsdp_process as worker  # noqa: E402

#: The precision TRL's default ``bf16=True`` gets here: "bf16" on a CPU with native bfloat16, else the worker sets
#: ``bf16=False`` and says so in the test id.
PRECISION = "bf16" if cpu_has_native_bf16() else "float32"
#: What each version runs in bf16, for the single-process reference: FSDP1: accelerate's ``MixedPrecision`` rounds the
#: parameters AND the buffers (the rotary ``inv_freq``) to bf16, under accelerate's bf16 autocast; FSDP2: the
#: parameters (``MixedPrecisionPolicy.param_dtype``; FSDP2 leaves buffers alone); ZeRO-3: DeepSpeed's bf16 parameters.
BF16_COMPUTE = {1: dict(buffers=True), 2: dict(buffers=False), "zero3": dict(buffers=False)}


def _launch(version: int | str, out) -> list[dict]:
    """``version`` 1 / 2: FSDP1 / FSDP2 (trl_fsdp_process.py); "zero3": DeepSpeed ZeRO-3 on its CPU accelerator
    (trl_zero3_process.py). The children import the oar this process imported (``_subproc.child_env``)."""
    exe = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if exe is None:
        pytest.skip("accelerate CLI not found")
    mode = ["--use_deepspeed"] if version == "zero3" else ["--multi_gpu"]
    worker_args = ([str(WORKERS / "trl_zero3_process.py")] if version == "zero3"
                   else [str(WORKERS / "trl_fsdp_process.py"), str(version)])
    # --mixed_precision no: accelerate's own flag stays off; TrainingArguments' bf16 (GRPOConfig's default) sets it.
    cmd = [exe, "launch", *mode, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", *worker_args, str(out), PRECISION]
    env = child_env(TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env["PYTHONPATH"]])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [torch.load(out / f"rank{k}.pt", weights_only=False) for k in range(2)]


def _bf16_compute(model, buffers: bool):
    """The single-process model computing as a version does under bf16 (:data:`BF16_COMPUTE`): parameters rounded to
    bf16, floating buffers too when ``buffers``."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    for b in m.buffers() if buffers else ():
        if b.is_floating_point():
            b.data = b.data.to(torch.bfloat16)
    return m


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _id(version) -> str:
    name = f"fsdp{version}" if version != "zero3" else "zero3"
    return f"{name}-defaults-" + ("bf16" if PRECISION == "bf16" else "float32-no-native-bf16")


def _check_defaults(r: dict, what) -> None:
    """TRL's defaults took effect on one rank's run (module docstring)."""
    assert r["gradient_checkpointing"] and r["checkpointed"] > 0, what  # TRL's training forward, checkpointed
    assert r["checkpointed_in_attribution"] == 0, what  # no attribution forward (nor dummy) checkpointed
    dtype = "torch.bfloat16" if PRECISION == "bf16" else "torch.float32"
    assert r["bf16"] is (PRECISION == "bf16") and r["mixed_precision"] == ("bf16" if PRECISION == "bf16" else "no")
    assert r["dtypes"] == {dtype} and r["train_dtypes"] == {dtype}, (what, r["dtypes"], r["train_dtypes"])


def _single_process(version, method: str, r: dict):
    """The pipeline's result (``Pipeline.compute``) on one rank's batch in one process, on the initial weights as the
    run computed with them (float32, or :data:`BF16_COMPUTE` under bf16), chunks planned for the run's element size."""
    model, tok = tiny_random_llama(**worker.MODEL)
    if PRECISION == "bf16":
        model = _bf16_compute(model, **BF16_COMPUTE[version])
    return Pipeline(worker.config(method), tok).compute(RolloutBatch(**r["batch"]),
                                                        HFProbeModel(model, bytes_per_element=r["element_size"]))


def _check_scores(version, method: str, r: dict, alone: torch.Tensor, what: str) -> None:
    """The run's scores against the float64 scores (chunks planned for the run's element size): float32: rule 1 with
    the float32 error estimate, for the run and for the single process; bf16: within twice the single process's own
    bf16 error plus one bf16 ulp of the largest score (rule 1 for bf16, _tolerance.py), a budget below a quarter of
    the largest score."""
    model, tok = tiny_random_llama(**worker.MODEL)
    cfg, batch, es, got = worker.config(method), RolloutBatch(**r["batch"]), r["element_size"], r["scores"]
    if PRECISION == "float32":
        exact = pipeline_scores_estimate(cfg, tok, batch, model, bytes_per_element=es)
        assert_within_error_model(got, exact, what=what)
        assert_within_error_model(alone, exact, what=f"{what}, one process")
        return
    # the float64 scores alone (no float32 error estimate: the bf16 rule compares actual errors)
    value = Pipeline(cfg, tok).scores(batch, HFProbeModel(float64_model(model), bytes_per_element=es)).scores.double()
    if not bool(value.any()):  # nothing to attribute on this rank: every score is an exact 0
        assert not bool(got.any()) and not bool(alone.any()), what
        return
    scale = float(value.abs().max())
    ref_err = float((alone.double() - value).abs().max())
    assert 2 * ref_err < 0.25 * scale, (what, ref_err, scale)  # the budget can catch a wrong score
    assert_close_to_reference(got, value, alone, atol=float(ulp(scale, torch.bfloat16)), what=what)


@pytest.mark.parametrize("version", [pytest.param(1, id=_id(1)), pytest.param(2, id=_id(2)), pytest.param(
    "zero3", id=_id("zero3"), marks=pytest.mark.skipif(
        not _has_deepspeed(), reason="deepspeed not installed (pip install deepspeed; runs with DS_ACCELERATOR=cpu)"))])
def test_attribution_under_fsdp_matches_one_process(tmp_path, version):
    """FSDP1, FSDP2 and DeepSpeed ZeRO-3 (through accelerate, DeepSpeed's CPU accelerator on gloo), with TRL's
    defaults (module docstring)."""
    ranks = _launch(version, tmp_path)
    assert {r["oar_g"]["process_index"] for r in ranks} == {0, 1}
    for method in ("oar_g", "oar_p"):
        r = [ranks[0][method], ranks[1][method]]
        for k in range(2):
            _check_defaults(r[k], (version, method, k))
            if version == "zero3":  # the unwrapped module, every parameter partitioned (empty outside a gather)
                assert r[k]["distributed_type"] == "DistributedType.DEEPSPEED" and r[k]["finished"], (method, k)
                assert r[k]["policy"] == "LlamaForCausalLM" and r[k]["wrapped"] == "DeepSpeedEngine", (method, k)
                assert r[k]["ds_partitioned"] == r[k]["n_params"] > 0, (method, k)
                continue
            assert r[k]["distributed_type"] == "DistributedType.FSDP" and r[k]["finished"], (method, k)
            want = "FullyShardedDataParallel" if version == 1 else "FSDPLlamaForCausalLM"
            assert r[k]["policy"] == want and r[k]["wrapped"] == want, (method, k, r[k]["policy"])
        active = [int((x["batch"]["sequence_advantages"] != 0).sum()) for x in r]
        assert sorted(active)[0] == 0 and sorted(active)[1] >= 2, (method, active)  # unequal work
        assert r[0]["forwards"] == r[1]["forwards"] > 0, (method, r[0]["forwards"], r[1]["forwards"])
        for k in range(2):
            ref = _single_process(version, method, r[k])
            _check_scores(version, method, r[k], ref.scores, f"{_id(version)} {method} rank {k}")
            same = (r[k]["scores"] == ref.scores).all(dim=1)
            torch.testing.assert_close(r[k]["advantages"][same], ref.advantages[same], rtol=0, atol=0)
