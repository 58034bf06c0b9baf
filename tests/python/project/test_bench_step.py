"""benchmarks/python/bench_step.py end to end on a tiny fixed-shape run: every provider is timed on the same
rollouts and the table's ratios are consistent with its own times (the benchmark behind issue 3's step goals)."""

import csv
import sys

import pytest
import torch

from _paths import BENCH_PY

sys.path.insert(0, str(BENCH_PY))
import bench_step  # noqa: E402

PROVIDERS = ["grpo", "oar_g", "oar_p_window2", "oar_p_window8", "oar_p_window2_each_prompt",
             "oar_p_window8_each_prompt", "oar_p_screen0.25", "oar_p_screen1", "oar_p_gscreen0.25", "oar_p_gscreen1",
             "oar_p", "oar_p_all_rows", "oar_p_naive_batched", "oar_p_naive_serial"]


def test_fixed_suite_tiny_run(tmp_path):
    out = str(tmp_path / "step")
    assert bench_step.main(["--suite", "fixed", "--lengths", "8", "--repeats", "1", "--naive-stride", "2",
                            "--screen-fractions", "0.25", "1", "--screen-sample", "0.25", "--windows", "2", "8",
                            "--out", out]) == 0
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == PROVIDERS
    by = {r["provider"]: r for r in rows}
    grpo_s = float(by["grpo"]["grpo_step_s"])
    assert grpo_s > 0
    assert float(by["grpo"]["ratio_to_grpo"]) == 1.0
    for p in PROVIDERS[1:]:
        attr = float(by[p]["attribution_s"])
        assert attr > 0, p
        # one repeat: ratio = (GRPO step + attribution) / GRPO step exactly
        assert float(by[p]["ratio_to_grpo"]) == pytest.approx((grpo_s + attr) / grpo_s, rel=1e-9), p
        assert float(by[p]["naive_batched_over_this"]) == pytest.approx(
            float(by["oar_p_naive_batched"]["attribution_s"]) / attr, rel=1e-9), p
    assert int(by["oar_p_naive_batched"]["extrapolated_stride"]) == 2
    assert float(by["oar_p"]["skipped_rows_frac"]) == 0.0  # rewards 1, 0, 1, 0: no zero-advantage row
    # fidelity, measured in the timed repeat: screening off is exact OAR-P (the same engine: equal ranks, weights),
    # whatever the screen (a window of 8 re-runs all of 8 tokens: exact OAR-P within rounding, which can swap the
    # ranks of the untrained model's near-equal scores, so it is not compared here; test_screened checks its
    # values); a quarter of 8 tokens (2) + a quarter sampled (2) masked
    for full in (by["oar_p_screen1"], by["oar_p_gscreen1"]):
        assert float(full["spearman_vs_exact"]) == pytest.approx(1.0)
        assert float(full["top10_overlap_vs_exact"]) == 1.0 and float(full["weights_l1_vs_exact"]) < 1e-5
    assert float(by["oar_p_screen1"]["masked_frac"]) == 1.0 and by["oar_p_window8"]["masked_frac"] == ""
    assert float(by["oar_p_screen0.25"]["masked_frac"]) == float(by["oar_p_gscreen0.25"]["masked_frac"]) == 0.5
    for p in ("oar_g", "oar_p_window2", "oar_p_window8", "oar_p_screen0.25", "oar_p_gscreen0.25"):
        assert -1.0 <= float(by[p]["spearman_vs_exact"]) <= 1.0 and 0 <= float(by[p]["top10_overlap_vs_exact"]) <= 1
    assert by["oar_p"]["spearman_vs_exact"] == ""  # the reference itself is not compared
    with open(out + ".md") as f:
        assert f.readline().startswith("Device cpu")
    # without the naive providers: the others only, no naive column
    assert bench_step.main(["--suite", "fixed", "--lengths", "8", "--repeats", "1", "--no-naive", "--no-fidelity",
                            "--screen-fractions", "--windows", "--out", out]) == 0
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["grpo", "oar_g", "oar_p", "oar_p_all_rows"]
    assert all(r["naive_batched_over_this"] == "" and r["spearman_vs_exact"] == "" for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a CUDA device")
def test_cuda_device_without_cuda_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench_step.main(["--device", "cuda", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="cpu, cuda or cuda:N"):
        bench_step.main(["--device", "meta", "--out", str(tmp_path / "x")])
