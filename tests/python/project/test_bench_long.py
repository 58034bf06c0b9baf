"""benchmarks/python/bench_long.py's logic on a tiny random model (plumbing only: random weights give no fidelity
numbers): every setting's row appears, a setting equal to exact OAR-P ranks like it, and a rerun resumes from the
cache files (exact references block by block)."""

import csv
import json
import sys

import pytest

from _paths import BENCH_ANALYSIS, BENCH_PY

sys.path.insert(0, str(BENCH_PY))
sys.path.insert(0, str(BENCH_ANALYSIS))  # fidelity_table.py, an analysis of bench_long's caches
import bench_long  # noqa: E402

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "tokenizer": "minimal", "initializer_range": 0.12}


def _traces(path):
    from oar.testing import minimal_tokenizer

    tok = minimal_tokenizer()
    texts = {24: ["First we add 2 and 3.\nSo", "Then x = 7, so 2x is 14."],
             40: ["We multiply 6 by 7 to get 42.\nCheck: 42/7=6."]}
    rows = []
    for bucket, ts in texts.items():
        for i, t in enumerate(ts):
            ids = tok.encode(t, add_special_tokens=False)
            rows.append({"id": f"t{bucket}-{i}", "bucket": bucket, "length": len(ids), "answer": "42",
                         "prompt_ids": tok.encode("Q: what is 6*7?\n", add_special_tokens=False), "response_ids": ids})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def _run(tmp_path, *extra):
    return bench_long.main(["--traces", str(tmp_path / "traces.jsonl"), "--lengths", "24", "40", "--per-length", "2",
                            "--model", "tiny-random-llama", "--model-kwargs", json.dumps(TINY), "--group", "2",
                            "--exact-block", "8", "--out", str(tmp_path / "out"), "--settings", "oar_g", "window8",
                            "screen0.2", "window_all", *extra])


def _table(tmp_path):
    with open(tmp_path / "out" / "long.csv") as f:
        return {(int(r["length"]), r["setting"]): r for r in csv.DictReader(f)}


def test_rows_exactness_and_resume(tmp_path, monkeypatch):
    _traces(tmp_path / "traces.jsonl")
    # one more row of the settings table: the window covering every later token is exact OAR-P
    monkeypatch.setattr(bench_long, "SETTINGS", bench_long.SETTINGS + [
        bench_long.Setting("window_all", bench_long._window(10**6), note="window past the end: exact")])
    assert _run(tmp_path) == 0
    table = _table(tmp_path)
    for L in (24, 40):
        for name in ("oar_p_exact", "oar_g", "window8", "screen0.2", "window_all"):
            r = table[(L, name)]
            assert float(r["seconds"]) > 0 and float(r["x_grpo"]) > 0, (L, name)
            assert int(r["with_reference"]) == int(r["traces"]) == (2 if L == 24 else 1), (L, name)
        assert float(table[(L, "window_all")]["spearman"]) == pytest.approx(1.0, abs=1e-6)
        assert float(table[(L, "window_all")]["top10"]) == 1.0
        assert float(table[(L, "oar_p_exact")]["x_exact"]) == 1.0
    md = (tmp_path / "out" / "long.md").read_text()
    assert "### L = 24: 2 traces" in md and "| window_all |" in md
    assert (tmp_path / "out" / "fidelity_cost_L40.png").exists()

    # resume: nothing cached is recomputed ...
    import oar.attribution as A

    def boom(*a, **k):
        raise AssertionError("a cached result was recomputed")

    monkeypatch.setattr(A, "oar_p_scores", boom)
    monkeypatch.setattr(bench_long, "grpo_step", boom)
    for s in bench_long.SETTINGS:
        monkeypatch.setattr(s, "run", boom)
    assert _run(tmp_path) == 0
    assert _table(tmp_path)[(24, "window_all")]["spearman"] == table[(24, "window_all")]["spearman"]

    # ... and an exact reference cut short resumes at its missing block only
    path = tmp_path / "out" / "cache" / "t24-0.json"
    cache = json.loads(path.read_text())
    lost = cache["exact_blocks"].pop("8")
    path.write_text(json.dumps(cache))
    calls = []
    from oar.attribution.oar_p import oar_p_scores

    monkeypatch.setattr(A, "oar_p_scores", lambda *a, **k: calls.append(k["positions"]) or oar_p_scores(*a, **k))
    assert _run(tmp_path) == 0
    assert calls == [{0: list(range(lost["start"], lost["end"]))}]
    assert json.loads(path.read_text())["exact_blocks"]["8"]["scores"] == pytest.approx(lost["scores"], rel=1e-4)
    assert _table(tmp_path)[(24, "window_all")]["spearman"] == table[(24, "window_all")]["spearman"]


def test_exact_stride_scores_every_kth_position_and_fidelity_table(tmp_path, monkeypatch):
    """--exact-stride k: the exact reference scores positions j % k == 0 only, fidelity is measured there, a resume
    with another stride is refused; fidelity_table.py reads the caches (window_all ranks exactly like exact)."""
    import fidelity_table

    _traces(tmp_path / "traces.jsonl")
    monkeypatch.setattr(bench_long, "SETTINGS", bench_long.SETTINGS + [
        bench_long.Setting("window_all", bench_long._window(10**6), note="window past the end: exact")])
    args = ["--traces", str(tmp_path / "traces.jsonl"), "--lengths", "24", "--per-length", "2", "--model",
            "tiny-random-llama", "--model-kwargs", json.dumps(TINY), "--no-grpo", "--exact-block", "8", "--out",
            str(tmp_path / "out"), "--settings", "window_all", "window4_linear", "--exact-stride", "3"]
    assert bench_long.main(args) == 0
    cache = json.loads((tmp_path / "out" / "cache" / "t24-0.json").read_text())
    assert cache["exact_stride"] == 3
    exact = bench_long.exact_scores(cache)
    L = cache["reasoning_len"]
    assert [j for j in range(L) if exact[j] is not None] == list(range(0, L, 3))
    # the stride's scores are exact OAR-P's at those positions (the window past the end is exact OAR-P, by another
    # engine): two float32 KLs of near-equal distributions differ by ~ eps32 x |log p| x a few terms ~ 1e-6
    full = cache["settings"]["window_all"]["scores"]
    assert max(full) > 1e-4
    assert [exact[j] for j in range(0, L, 3)] == pytest.approx([full[j] for j in range(0, L, 3)], rel=0, abs=2e-6)
    lin = cache["settings"]["window4_linear"]
    assert lin["tokens"] > lin["forward_tokens"] > 0  # token-columns: forward + backward
    md = (tmp_path / "out" / "long.md").read_text()
    assert "oar_p_exact (every 3-th position)" in md
    with pytest.raises(SystemExit, match="--exact-stride 3"):
        bench_long.main(args[:-1] + ["2"])
    out = tmp_path / "fid.md"
    assert fidelity_table.main(["--set", f"tiny:{tmp_path / 'out'}:{tmp_path / 'traces.jsonl'}", "--out",
                                str(out)]) == 0
    text = out.read_text()
    assert "| tiny | t24-0 |" in text and "| tiny | t24-1 |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| tiny | t24-0 |"))
    from oar.app.stats import spearman

    # the table's Spearman is the one on the scored positions (8 of 24 here)
    want = spearman(*bench_long.paired(lin["scores"], exact))
    assert row.endswith(f"| {want:.3f} |") and "| 8 (3) |" in row
