"""OARGRPOTrainer under FSDP1, FSDP2 and DeepSpeed ZeRO-3 (when deepspeed is installed: trl_zero3_process.py, with
DeepSpeed's CPU accelerator): 2 processes (accelerate launch, gloo, CPU), the real trl / accelerate / torch FSDP code,
accelerate's FSDP plugin enabled on CPU by the test scaffold ``_cpu_fsdp`` (accelerate offers FSDP on accelerator
devices only; the wrapping is the one GPUs get).

Per FSDP version and method (oar_g, oar_p), checked on each rank (the worker is ``trl_fsdp_process.py``):
- TRL's step finishes on both ranks although one rank has nothing to attribute and the other up to four rows;
- both ranks ran the same number of policy forwards during attribution (a rank that ran fewer would leave the
  other's parameter all-gathers waiting);
- the scores equal those of the single-process pipeline on the same batch with the same (unsharded) weights:
  rule 1 of ``_tolerance.py``: the FSDP run and the single-process run both within the random-rounding estimate
  of the float32 error around the float64 model's scores (``_error_model.py``); the advantages are exact where
  the scores are.
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

from oar.app.models import tiny_random_llama  # noqa: E402
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline

from _error_model import pipeline_scores_estimate  # noqa: E402
from _tolerance import assert_within_error_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trl_fsdp_process as worker  # noqa: E402


def _launch(version: int | str, out) -> list[dict]:
    """``version`` 1 / 2: FSDP1 / FSDP2 (trl_fsdp_process.py); "zero3": DeepSpeed ZeRO-3 on its CPU accelerator
    (trl_zero3_process.py)."""
    exe = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if exe is None:
        pytest.skip("accelerate CLI not found")
    mode = ["--use_deepspeed"] if version == "zero3" else ["--multi_gpu"]
    worker_args = ([os.path.join(HERE, "trl_zero3_process.py")] if version == "zero3"
                   else [os.path.join(HERE, "trl_fsdp_process.py"), str(version)])
    cmd = [exe, "launch", *mode, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", *worker_args, str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [torch.load(out / f"rank{k}.pt", weights_only=False) for k in range(2)]


def _single_process(method: str, batch: dict, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline's scores of ``batch`` in one process, on the initial weights (float32)."""
    assert dtype == torch.float32
    model, tok = tiny_random_llama(**worker.MODEL)
    return Pipeline(worker.config(method), tok).compute(RolloutBatch(**batch), model)


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize("version", [1, 2, pytest.param("zero3", marks=pytest.mark.skipif(
    not _has_deepspeed(), reason="deepspeed not installed (pip install deepspeed; runs with DS_ACCELERATOR=cpu)"))])
def test_attribution_under_fsdp_matches_one_process(tmp_path, version):
    """FSDP1, FSDP2 and DeepSpeed ZeRO-3 (through accelerate, DeepSpeed's CPU accelerator on gloo)."""
    ranks = _launch(version, tmp_path)
    assert {r["oar_g"]["process_index"] for r in ranks} == {0, 1}
    for method in ("oar_g", "oar_p"):
        r = [ranks[0][method], ranks[1][method]]
        for k in range(2):
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
            ref32 = _single_process(method, r[k]["batch"], torch.float32)
            model, tok = tiny_random_llama(**worker.MODEL)  # rule 1: float64 scores, float32 error estimate
            exact = pipeline_scores_estimate(worker.config(method), tok, RolloutBatch(**r[k]["batch"]), model)
            got = r[k]["scores"]
            assert_within_error_model(got, exact, what=f"FSDP{version} {method} rank {k}")
            assert_within_error_model(ref32.scores, exact, what=f"one process {method} rank {k}")
            same = (got == ref32.scores).all(dim=1)
            torch.testing.assert_close(r[k]["advantages"][same], ref32.advantages[same], rtol=0, atol=0)
