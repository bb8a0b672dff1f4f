"""`pagedllm bench attention --kv-cache-dtype`: rows for the op over a 16-bit cache beside float32."""

import pytest

from pagedllm.bench.attention import attention_table, run_attention


def test_attention_bench_gains_16_bit_rows():
    result = run_attention([("decode", 2, 40), ("prefill", 1, 24)], repeats=1, progress=False, mixed=None,
                           kv_cache_dtype="bfloat16")
    for row in result["rows"]:
        narrow = row["narrow_kv"]
        assert narrow["kv_cache_dtype"] == "bfloat16"
        assert narrow["kv_mb"] == pytest.approx(row["kv_mb"] / 2)  # the floor counts 16-bit bytes
        assert narrow["floor_ms"] == pytest.approx(row["floor_ms"] / 2)
        assert narrow["reference_ms"] > 0
    _, table = attention_table(result)
    assert [r[0] for r in table][::2] == ["decode", "prefill"]
    assert all(r[0].startswith("  bfloat16 KV (op / f32 op ") for r in table[1::2])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        run_attention([("decode", 1, 8)], repeats=1, progress=False, mixed=None, kv_cache_dtype="float8")


def test_attention_bench_without_the_option_has_no_16_bit_rows():
    result = run_attention([("decode", 2, 40)], repeats=1, progress=False, mixed=None)
    assert result["rows"][0]["narrow_kv"] is None
    assert len(attention_table(result)[1]) == 1
