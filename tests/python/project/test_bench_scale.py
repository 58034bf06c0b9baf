"""benchmarks/python/bench_scale.py (issue 23): the cost model's forwards per row are exactly the token-columns the
engines run (their own ``tokens`` stats) on a one-row batch, and ``time`` runs every setting end to end."""

import csv
import sys

import pytest
import torch

from _paths import BENCH_PY

sys.path.insert(0, str(BENCH_PY))
import bench_scale as bs  # noqa: E402

from oar.testing import minimal_tokenizer, tiny_random_llama  # noqa: E402
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores  # noqa: E402


@pytest.fixture(scope="module")
def one_row():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    P, L = 30, 53
    batch = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(
        [torch.randint(6, 100, (P,), generator=g)], [torch.randint(6, 100, (L,), generator=g)], ["42"], [L])
    batch = batch.probe_view()  # what the OAR-P engines run: without the columns after the last probe position
    T = int(batch.input_ids.shape[1])
    tail = T - P - L
    assert int(batch.reasoning_start[0]) == P and T - int(batch.keep) >= P + L  # the model's assumptions hold
    return HFProbeModel(model), batch, P, L, T, tail


@pytest.mark.parametrize("window", [0, 8])
def test_window_count(one_row, window):
    pm, batch, P, L, T, tail = one_row
    res = oar_p_window_scores(pm, batch, window=window)
    assert res.stats["tokens"] == pytest.approx(bs.forwards_per_row("window", L, P, tail, window=window) * T)


@pytest.mark.parametrize("unit_len", [1, 7, 25])
def test_span_counts(one_row, unit_len):
    pm, batch, P, L, T, tail = one_row
    spans = {0: [(s, min(s + unit_len, L)) for s in bs.unit_starts(L, unit_len)]}
    exact = oar_p_scores(pm, batch, spans=spans, engine="prefix", max_variants_per_chunk=1)
    assert exact.stats["tokens"] == pytest.approx(bs.forwards_per_row("span", L, P, tail, unit_len=unit_len) * T)
    for window in (0, 8):
        win = oar_p_window_scores(pm, batch, window=window, spans=spans)
        want = bs.forwards_per_row("span_window", L, P, tail, window=window, unit_len=unit_len) * T
        assert win.stats["tokens"] == pytest.approx(want)
    if unit_len == 1:  # one-token units are exact token OAR-P
        assert bs.forwards_per_row("span", L, P, tail, unit_len=1) == pytest.approx(
            bs.forwards_per_row("exact", L, P, tail))


@pytest.mark.parametrize("window", [0, 8])
def test_window_probe_tail_count(one_row, window):
    pm, batch, P, L, T, tail = one_row
    res = oar_p_window_scores(pm, batch, window=window, rerun_tail="probe")
    want = bs.forwards_per_row("window_probe", L, P, tail, window=window, keep=int(batch.keep)) * T
    assert res.stats["tokens"] == pytest.approx(want)
    spans = {0: [(s, min(s + 7, L)) for s in bs.unit_starts(L, 7)]}
    res = oar_p_window_scores(pm, batch, window=window, rerun_tail="probe", spans=spans)
    want = bs.forwards_per_row("span_window_probe", L, P, tail, window=window, unit_len=7, keep=int(batch.keep)) * T
    assert res.stats["tokens"] == pytest.approx(want)


@pytest.mark.parametrize("window", [0, 8, 60])
def test_window_linear_count(one_row, window):
    """The linear tail's token-columns (forward + 2 tail columns per output gradient) are the cost model's; W = 60
    reaches the tail from every token: exact re-runs only, as the prefix engine's suffixes."""
    from oar.attribution import oar_p_linear_tail_scores

    pm, batch, P, L, T, tail = one_row
    res = oar_p_linear_tail_scores(pm, batch, window=window)
    assert res.stats["backward_passes"] == bs.LINEAR_READOUTS * (res.stats["linearized"] > 0)
    want = bs.forwards_per_row("window_linear", L, P, tail, window=window) * T
    if window == 60:  # no Jacobian: nothing linearized
        want -= tail * (1 + 2 * bs.LINEAR_READOUTS)
        assert want == pytest.approx(T + sum(T - (P + t) for t in range(L)))
    assert res.stats["cost_tokens"] == pytest.approx(want)


@pytest.mark.parametrize("window", [0, 8])
def test_prompt_once_count(one_row, window):
    """G rollouts of one prompt (same length): the prompt-once clean pass runs the prompt once, the count's clean
    term 1 - (1 - 1/G) P / T."""
    pm, batch, P, L, T, tail = one_row
    G = 4
    group = ProbeContextBuilder(minimal_tokenizer(), "\nTherefore, the final answer is \\boxed{").build(
        [batch.input_ids[0, :P]] * G, [batch.input_ids[0, P:P + L]] * G, ["42"] * G, [L] * G)
    res = oar_p_window_scores(pm, group, window=window)
    want = bs.forwards_per_row("window", L, P, tail, window=window, group=G) * T * G
    assert res.stats["tokens"] == pytest.approx(want)
    assert bs.forwards_per_row("window", L, P, tail, window=window, group=G) == pytest.approx(
        bs.forwards_per_row("window", L, P, tail, window=window) - (1 - 1 / G) * P / T)


def test_cost_table_orders_the_settings():
    rows = {(r["L"], r["setting"]): r["forwards_per_row"] for r in bs.cost_table([4096], 200, 40, 8, [25], 0.1)}
    assert rows[4096, "span_window 25 W=8"] < rows[4096, "window W=8"] < rows[4096, "span 25"] < rows[4096, "exact"]
    assert rows[4096, "grpo"] == bs.GRPO_FORWARDS
    with pytest.raises(ValueError, match="setting must be one of"):
        bs.forwards_per_row("bogus", 10, 1, 1)


def test_time_runs_every_setting(tmp_path):
    rows = bs.time_settings("tiny", 40, "cpu", "float32", window=2, unit_len=8, prompt=16, repeats=1,
                            scored_fraction=0.5, out=str(tmp_path))
    names = ["oar_g", "window W=2", "window_probe W=2", "window_linear W=2", "span 8", "span_window 8 W=2",
             "span_window_probe 8 W=2"]
    assert [r["setting"] for r in rows] == ["dense_forward", "grpo_update_proxy"] + names + ["grpo_step"]
    by = {r["setting"]: r for r in rows}
    assert all(r["seconds"] > 0 for r in rows)
    assert by["span 8"]["variants"] == by["span_window 8 W=2"]["variants"] == 5 and by["window W=2"]["variants"] == 40
    assert by["span_window 8 W=2"]["tokens"] < by["span 8"]["tokens"]
    assert by["span_window_probe 8 W=2"]["tokens"] < by["span_window 8 W=2"]["tokens"]
    dense = by["dense_forward"]
    tv = int(ProbeContextBuilder(minimal_tokenizer(), "\nTherefore, the final answer is \\boxed{").build(
        [[6] * 16], [[7] * 40], ["42"], [40]).probe_view().input_ids.shape[1])  # the width the engines run
    assert dense["E"] == 1.0 and dense["tokens"] == (8192 // tv) * tv  # whole rows of that width
    step = by["grpo_step"]["seconds"]
    assert step == pytest.approx(by["grpo_update_proxy"]["seconds"] * 5 / 3, rel=1e-3, abs=1e-4)  # no generation
    for n in names:
        r = by[n]
        assert r["E"] == pytest.approx(r["tokens"] / r["seconds"] / (dense["tokens"] / dense["seconds"]), rel=0.02)
        assert r["x_grpo_step_batch_row"] == pytest.approx(0.5 * r["x_grpo_step_scored_row"], abs=1e-3)
        assert r["x_grpo_step_scored_row"] == pytest.approx(r["seconds"] / step, rel=0.02, abs=1e-3)
    assert by["window W=2"]["cost_forwards"] * tv == pytest.approx(by["window W=2"]["tokens"], abs=1)
    assert by["window_linear W=2"]["cost_forwards"] * tv == pytest.approx(by["window_linear W=2"]["tokens"], abs=1)
    with open(tmp_path / "time_tiny_L40_cpu.csv") as f:  # the table as written after the last call
        assert [r["setting"] for r in csv.DictReader(f)] == [r["setting"] for r in rows]
    two = bs.time_settings("tiny", 24, "cpu", "float32", window=2, unit_len=8, prompt=16, repeats=1, group=2,
                           settings=["window"])
    by = {r["setting"]: r for r in two}
    assert set(by) == {"dense_forward", "grpo_update_proxy", "window W=2", "window W=2 [each prompt]", "grpo_step"}
    assert by["window W=2 [each prompt]"]["tokens"] - by["window W=2"]["tokens"] == 16  # one prompt of 16 not re-run
    with pytest.raises(ValueError, match="settings must be among"):
        bs.time_settings("tiny", 24, "cpu", "float32", window=2, unit_len=8, settings=["windw"])
    with pytest.raises(ValueError, match="scored_fraction must be in"):
        bs.time_settings("tiny", 24, "cpu", "float32", window=2, unit_len=8, scored_fraction=0.0)


def test_time_writes_each_call(tmp_path, monkeypatch):
    """A run stopped after its first calls leaves a table of what it measured (the stop simulated by an error in
    the third call), first calls marked ``timed: false``."""
    calls = []
    real = bs._write

    def counting(rows, out, name, title):
        calls.append([r["setting"] for r in rows])
        real(rows, out, name, title)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(bs, "_write", counting)
    with pytest.raises(KeyboardInterrupt):
        bs.time_settings("tiny", 24, "cpu", "float32", window=2, unit_len=8, prompt=16, repeats=1,
                         settings=["window_probe"], out=str(tmp_path))
    assert calls == [["dense_forward"], ["dense_forward", "grpo_update_proxy", "grpo_step"],
                     ["dense_forward", "grpo_update_proxy", "window_probe W=2", "grpo_step"]]
    with open(tmp_path / "time_tiny_L24_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["setting"] for r in rows] == calls[-1] and rows[2]["timed"] == "False" and float(rows[2]["seconds"]) > 0


    assert bs.main(["cost", "--lengths", "512", "--unit-len", "25", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "cost_model.csv") as f:
        assert len(list(csv.DictReader(f))) == 10
