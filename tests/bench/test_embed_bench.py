"""`pagedllm bench embed` in a smoke size: tiny random encoder and decoder embedders and a tiny cross-encoder,
both systems timed on texts of exactly the lengths asked for, their vectors and scores in agreement, the
ratios in the JSON result and the printed table."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.embed import MIXED_LOAD
from pagedllm.bench.embed_models import mixed_lengths
from pagedllm.entrypoints.cli import main


def test_embed_bench_smoke(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "embed", "--out", str(out), "--shapes", "bert-tiny,qwen3-tiny",
            "--rerank-shape", "bert-tiny", "--num-texts", "6", "--decoder-num-texts", "4", "--max-len", "64", "--rounds", "2", "--threads", "1",
            "--dtype", "float32"]
    assert main(argv) == 0
    result = json.loads((out / "embed.json").read_text())
    assert result["threads"] == 1 and result["weights"] == "random"
    assert [e["shape"] for e in result["embed"]] == ["bert-tiny", "qwen3-tiny"]
    # every text is exactly its drawn length once the tokenizer adds [CLS]/[SEP] (encoder) or EOS (decoder)
    expected = {"bert-tiny": (6, sum(mixed_lengths(6, 8, 64, seed=0))),
                "qwen3-tiny": (4, sum(mixed_lengths(4, 8, 64, seed=0)))}
    for entry in [*result["embed"], result["rerank"]]:
        ours, theirs = entry["systems"]["pagedllm"], entry["systems"]["sentence-transformers"]
        assert len(ours["seconds"]) == len(theirs["seconds"]) == 2
        assert entry["ratio_best"]["pagedllm"] == pytest.approx(ours["best_per_s"] / theirs["best_per_s"])
        assert entry["ratio_median"]["pagedllm"] == pytest.approx(ours["median_per_s"] / theirs["median_per_s"])
        assert entry["agreement"]["pagedllm"]["max_abs_diff"] < 1e-4, entry
    for entry in result["embed"]:
        assert (entry["num_texts"], entry["num_tokens"]) == expected[entry["shape"]]
        assert entry["agreement"]["pagedllm"]["min_cosine"] > 0.9999
    assert result["rerank"]["num_pairs"] == 6
    assert result["mixed_load"] == MIXED_LOAD
    printed = capsys.readouterr().out
    assert "| bert-tiny | pagedllm | 6 |" in printed and "| qwen3-tiny | pagedllm | 4 |" in printed and "ratio best" in printed
    assert "reranking (LLM.score vs CrossEncoder.predict)" in printed


def test_embed_bench_refuses_unknown_shape(tmp_path):
    with pytest.raises(SystemExit, match="unknown shape 'bert-huge'"):
        main(["bench", "embed", "--out", str(tmp_path), "--shapes", "bert-huge"])


def test_embed_bench_dtypes_side_by_side_are_recorded_and_close(tmp_path, capsys):
    """--dtype float32,bf16-matmul,bfloat16: one engine each, timed in the same rounds beside sentence-transformers
    (float32); float32 is exact, the others differ by their bf16 rounding, not more, and the table names each."""
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "embed", "--out", str(out), "--shapes", "bert-tiny", "--rerank-shape",
            "bert-tiny", "--num-texts", "6", "--max-len", "64", "--rounds", "1", "--threads", "1",
            "--dtype", "float32,bf16-matmul,bfloat16"]
    assert main(argv) == 0
    result = json.loads((out / "embed.json").read_text())
    assert result["dtype"] == "float32,bf16-matmul,bfloat16"
    for entry in (result["embed"][0], result["rerank"]):
        agreement = entry["agreement"]
        assert set(entry["ratio_best"]) == set(agreement) == {"pagedllm float32", "pagedllm bf16-matmul",
                                                               "pagedllm bfloat16"}
        assert agreement["pagedllm float32"]["max_abs_diff"] < 1e-4, agreement
        assert 1e-7 < agreement["pagedllm bf16-matmul"]["max_abs_diff"] < 2e-3, agreement
        assert 1e-6 < agreement["pagedllm bfloat16"]["max_abs_diff"] < 5e-2, agreement
    assert result["embed"][0]["agreement"]["pagedllm bf16-matmul"]["min_cosine"] > 0.9999
    printed = capsys.readouterr().out
    assert "| bert-tiny | pagedllm bf16-matmul | 6 |" in printed and "pagedllm dtype float32,bf16-matmul" in printed


def test_embed_bench_refuses_unknown_dtype(tmp_path):
    with pytest.raises(SystemExit, match="--dtype: distinct values"):
        main(["bench", "embed", "--out", str(tmp_path), "--dtype", "float32,int4"])


def test_embed_mixed_bench_smoke(tmp_path, capsys):
    """`bench embed-mixed` on the default model served with --runner both: each round times the generation load
    alone and with embedding requests, every embedding token counted in the share."""
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "embed-mixed", "--out", str(out), "--num-generations", "2",
            "--prompt-len", "16", "--output-len", "4", "--num-embed-requests", "2", "--embed-inputs", "3",
            "--embed-len", "8", "--rounds", "1", "--threads", "1"]
    assert main(argv) == 0
    result = json.loads((out / "embed-mixed.json").read_text())
    assert result["serve_args"][:2] == ["--runner", "both"]
    assert result["embedding"]["tokens"] == 2 * 3 * 8 and result["generation"]["tokens"] == 2 * 16 + 2 * 4
    assert result["token_share"] == pytest.approx(48 / (48 + 40))
    assert len(result["alone_s"]) == len(result["mixed_s"]) == 1 and result["alone_s"][0] > 0
    assert "within the share" in capsys.readouterr().out
