"""OARGRPOTrainer with 2 processes (accelerate launch, gloo backend, CPU) and the real trl package.

One group of 8 completions is split 4 / 4 across the processes. Checks, on each rank:
- TRL's sequence advantages are the group statistics of the GATHERED rewards, sliced to the rank;
- the per-token advantages' row sums equal those sliced sequence advantages times the completion lengths;
- both ranks ran the same number of attribution forwards (oar.distributed keeps them in step) although their
  own work differs;
- KTAE's token tables are built on the whole group (gathered across the ranks) and sliced back.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from oar import baselines, ops  # noqa: E402

from _error_model import error_bound  # noqa: E402
from _paths import WORKERS  # noqa: E402
from _tolerance import assert_within, assert_within_error_model, gamma, sum_bound, ulp  # noqa: E402
from _trainer_formulas import trl_advantages  # noqa: E402  (TRL's formula, written out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl2")
    exe = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if exe is None:
        pytest.skip("accelerate CLI not found")
    # --multi_gpu selects accelerate's torch.distributed launcher; with use_cpu=True the processes run on CPU with
    # gloo (the --cpu flag alone would start a single process).
    cmd = [exe, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", str(WORKERS / "trl_two_process.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [torch.load(out / f"rank{k}.pt") for k in range(2)]


def test_groups_normalized_over_gathered_batch(ranks):
    for method in ("oar_p", "ktae"):
        r0, r1 = ranks[0][method], ranks[1][method]
        assert r0["num_processes"] == 2 and {r0["process_index"], r1["process_index"]} == {0, 1}
        rewards = r0["rewards_all"]
        torch.testing.assert_close(rewards, r1["rewards_all"])  # every rank sees the gathered rewards
        assert rewards.shape == (8,)
        full = ops.group_advantages(rewards, group_size=8, preset="trl")
        # TRL computes these itself, in float32: rule 1, its formula over the gathered group in float64 with the
        # float32 error model of that formula (_error_model.py)
        exact = error_bound(lambda x: trl_advantages(x, 8, "group"), rewards)
        for k, r in enumerate((r0, r1)):
            sl = slice(4 * k, 4 * k + 4)
            assert_within_error_model(r["seq_adv"], exact[sl], what=f"{method} rank {k}")
        local = ops.group_advantages(rewards[:4], group_size=4, preset="trl")
        if not torch.allclose(local, full[:4], atol=1e-3):  # the data make a local normalization visibly wrong
            assert not torch.allclose(r0["seq_adv"], local, atol=1e-3)


def test_row_sums_equal_sliced_sequence_advantages_times_lengths(ranks):
    for r in (ranks[0]["oar_p"], ranks[1]["oar_p"]):
        mask = r["completion_mask"].bool()
        tok = r["tok_adv"]
        assert tok.shape == mask.shape
        # Mass preservation: each token advantage carries 2 float32 roundings (weight, weight x A), the float32 row
        # sum here gamma_{C-1}, the right-hand product one more.
        want = r["seq_adv"] * mask.sum(1)
        abs_tok = tok.double().abs().sum(1)
        assert_within(tok.sum(1), want, gamma(2) * abs_tok + sum_bound(abs_tok, tok.shape[1]) + ulp(want))
        assert (tok[~mask] == 0).all()


def test_every_rank_runs_the_same_number_of_attribution_forwards(ranks):
    r0, r1 = ranks[0]["oar_p"], ranks[1]["oar_p"]
    assert r0["attribution_forwards"] == r1["attribution_forwards"] > 0
    # the count is the rank's own forwards plus its padding; the ranks' own work differed (chunk caps 3 and 7)
    for r in (r0, r1):
        assert r["attribution_forwards"] == r["forward_passes"] + r["padding_forwards"]
    assert r0["forward_passes"] != r1["forward_passes"]
    assert r0["padding_forwards"] + r1["padding_forwards"] > 0


def test_ktae_tables_span_the_gathered_group(ranks):
    r0, r1 = ranks[0]["ktae"], ranks[1]["ktae"]
    C = max(r0["completion_ids"].shape[1], r1["completion_ids"].shape[1])
    pad = r0["pad"]

    def widen(t, v):
        return torch.nn.functional.pad(t, (0, C - t.shape[1]), value=v)

    ids = torch.cat([widen(r0["completion_ids"], pad), widen(r1["completion_ids"], pad)])
    mask = torch.cat([widen(r0["completion_mask"], 0), widen(r1["completion_mask"], 0)]).bool()
    seq = torch.cat([r0["seq_adv"], r1["seq_adv"]])
    bonus = baselines.ktae_token_scores(ids, mask, r0["rewards_all"], group_size=8,
                                        ignore_ids=sorted({r0["eos"], r0["pad"]}))
    exp = (seq[:, None] + bonus) * mask
    for k, r in enumerate((r0, r1)):
        c = r["tok_adv"].shape[1]
        torch.testing.assert_close(r["tok_adv"], exp[4 * k: 4 * k + 4, :c], rtol=1e-5, atol=1e-5)
