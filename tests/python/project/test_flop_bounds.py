"""The FLOP counts behind docs/benchmarks.md's bounds on exact OAR-P (benchmarks/python/flop_bounds.py)
against torch's own FLOP counter on a real (tiny) Llama forward, and their ordering invariants."""

import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from _paths import BENCH_PY

sys.path.insert(0, str(BENCH_PY))
import flop_bounds as fb  # noqa: E402

from oar.testing import tiny_random_llama  # noqa: E402


@pytest.fixture(scope="module")
def eager_llama():
    # Grouped-query attention (2 kv heads for 4 heads) so that the k/v projection count is exercised.
    model, _ = tiny_random_llama(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0,
                                 tokenizer="minimal")
    model.eval()
    model.set_attn_implementation("eager")  # attention as matmuls, which FlopCounterMode counts (dense)
    return model


@pytest.mark.parametrize("T,keep", [(10, 3), (17, 17), (5, 1)])
def test_dense_forward_matches_torch_flop_counter(eager_llama, T, keep):
    s = fb.Shape.of(eager_llama.config)
    ids = torch.randint(4, 100, (1, T), generator=torch.Generator().manual_seed(T))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        eager_llama(input_ids=ids, logits_to_keep=keep)
    assert fb.forward_flops(s, 0, T, T, keep) == fc.get_total_flops()


def test_causal_pairs_and_shape_terms():
    assert fb.causal_pairs(2, 5) == 3 + 4 + 5
    assert fb.causal_pairs(0, 0) == 0
    s = fb.Shape(hidden=2, intermediate=3, layers=1, heads=1, kv_heads=1, head_dim=2, vocab=5)
    # q, o: 2 * 2 * 2 * 2 = 16; k, v: 16; gated MLP: 3 * 2 * 2 * 3 = 36
    assert s.token_flops() == 68
    assert s.pair_flops() == 8
    assert s.lm_head_flops() == 20
    assert fb.forward_flops(s, 0, 3, None, 3) == 3 * 68 + 6 * 8 + 3 * 20


def test_provider_ordering_and_one_column_chunks(eager_llama):
    s = fb.Shape.of(eager_llama.config)
    T, keep, rows = 40, 4, 2
    cols = [10 + j for j in range(20)] + [10 + j for j in range(20)]
    naive = fb.naive_batched_flops(s, T, cols)
    ideal = fb.ours_ideal_flops(s, T, cols, rows, keep)
    built = fb.ours_built_flops(s, T, cols, rows, keep, 0.25)
    dense = fb.ours_built_flops(s, T, cols, rows, keep, 0.25, dense=True)
    assert ideal < built < dense < naive
    # A waste bound below one column per chunk: every chunk holds the variants of one column, and the
    # as-built count is the clean passes + one suffix forward per variant from its own column.
    clean = rows * fb.forward_flops(s, 0, T, None, keep)
    tight = fb.ours_built_flops(s, T, cols, rows, keep, 1e-6, dense=True)
    assert tight == clean + sum(fb.forward_flops(s, c, T, T, keep) for c in cols)
    # and with causal suffixes, one chunk per column is exactly the ideal engine
    assert fb.ours_built_flops(s, T, cols, rows, keep, 1e-6) == ideal
