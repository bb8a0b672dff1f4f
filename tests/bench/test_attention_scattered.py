"""`pagedllm bench attention --scattered`: the op timed over blocks spread through a large cache."""

import pytest
import torch

from pagedllm.bench import attention
from pagedllm.bench.attention import attention_table, run_attention
from tests.model.conftest import require_compiled_cpu_ops


def test_scattered_rows_beside_the_hot_case():
    require_compiled_cpu_ops()
    # 2 sequences x 40 keys = 6 blocks per layer in a cache of ~170 blocks: each layer's set differs.
    result = run_attention([("decode", 2, 40), ("prefill", 1, 24)], repeats=1, progress=False, mixed=None,
                           scattered_gb=0.004)
    for row in result["rows"]:
        sc = row["scattered"]
        assert sc["layers"] == attention.SCATTERED_LAYERS
        assert sc["cache_gb"] == pytest.approx(0.004, rel=0.01)
        assert sc["op_ms"] > 0
    _, table = attention_table(result)
    assert [r[0] for r in table][::2] == ["decode", "prefill"]
    assert all(r[0].startswith("  scattered: 30 layers' blocks in 0.00398 GiB (op / hot op ") for r in table[1::2])


def test_scattered_op_reads_the_case_through_other_block_tables():
    require_compiled_cpu_ops()
    case = attention._Case([40, 17], [1, 1], 9, 3, 64, 16, seed=1)
    cache = torch.zeros(2, 64, 16, 3, 64)
    expected = case.reference()
    run = attention._scattered_op(case, cache, layers=3, expected=expected)  # checks layer 0's output
    run()
    assert cache.abs().sum() > 0  # the case's K/V were copied into the large cache
    wrong = expected + 1.0
    with pytest.raises(AssertionError):
        attention._scattered_op(case, cache, layers=1, expected=wrong)


def test_no_scattered_rows_without_the_option():
    result = run_attention([("decode", 2, 40)], repeats=1, progress=False, mixed=None)
    assert result["rows"][0]["scattered"] is None
    assert len(attention_table(result)[1]) == 1
