"""`pagedllm bench quant-gemm` and `pagedllm bench bf16-error` in smoke sizes: every kind and row count timed, the
bytes held against the file's as the kernels' layouts promise, bad kinds refused by name; each rounding's error
reported, small but not zero."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.bench.quant_gemm import parse_kinds
from pagedllm.entrypoints.cli import main
from pagedllm.model.layers import quantized


@pytest.mark.skipif(not quantized.int8_kernel_available(), reason="the int8-activation kernel does not run here")
def test_quant_gemm_bench_smoke(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "quant-gemm", "--out", str(out), "--n", "64", "--k", "512",
            "--rows", "1,5", "--kinds", "Q4_K:int8,Q4_K:float,Q4_0:int8", "--rounds", "2", "--repeats", "1"]
    assert main(argv) == 0
    result = json.loads((out / "quant-gemm.json").read_text())
    rows = {(r["type"], r["activations"]): r for r in result["results"]}
    assert set(rows) == {("Q4_K", "int8"), ("Q4_K", "float"), ("Q4_0", "int8")}
    for row in rows.values():
        assert row["n"] == 64 and row["k"] == 512
        assert set(row["ms"]) == {"1", "5"} and all(ms > 0 for ms in row["ms"].values())
        assert row["gb_s_one_row"] > 0
    assert rows[("Q4_K", "int8")]["held_over_file"] <= 1.05  # held at the file's size (docs/quantization.md)
    assert rows[("Q4_K", "float")]["held_over_file"] > 2  # the 12-bit QX panels of the float-activation path
    assert "M=5 ms" in capsys.readouterr().out


def test_quant_gemm_kinds_are_checked(capsys):
    assert parse_kinds("Q4_K:int8,Q6_K:float") == [("Q4_K", "int8"), ("Q6_K", "float")]
    with pytest.raises(argparse.ArgumentTypeError, match="'Q4_K:int4' is not TYPE:ACTIVATIONS"):
        parse_kinds("Q4_K:int4")
    with pytest.raises(argparse.ArgumentTypeError, match="'Q9_Z:int8'"):
        parse_kinds("Q9_Z:int8")
    with pytest.raises(SystemExit):
        main(["bench", "quant-gemm", "--kinds", "Q4_K:int4"])
    assert "argument --kinds: 'Q4_K:int4' is not TYPE:ACTIVATIONS" in capsys.readouterr().err


@pytest.mark.skipif(not quantized.kernel_available(), reason="the compiled quantized kernel does not run here")
def test_quant_gemm_refuses_columns_no_k_quant_block_fits(tmp_path):
    with pytest.raises(SystemExit, match="--k 300: the weight's columns must be a multiple of 256"):
        main(["bench", "quant-gemm", "--out", str(tmp_path), "--k", "300", "--kinds", "Q4_K:float"])


@pytest.mark.parametrize("cross_encoder", [False, True])
def test_bf16_error_bench_smoke(cross_encoder, tmp_path):
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "bf16-error", "--out", str(out), "--shape", "bert-tiny",
            "--num-texts", "4", "--threads", "1", *(["--cross-encoder"] if cross_encoder else [])]
    assert main(argv) == 0
    rows = json.loads((out / "bf16-error.json").read_text())["rows"]
    if cross_encoder:
        assert [r["float32_last_layers"] for r in rows] == list(range(rows[0]["layers"] + 1))
        assert rows[-1]["max_score_diff"] == 0.0  # every layer kept float32: the reference itself
        assert 0 < rows[0]["max_score_diff"] < 0.05
    else:
        assert [r["rounding"] for r in rows][-1] == "whole model in bfloat16"
        assert all(0.99 < r["min_cosine"] < 1.0 and r["max_abs_diff"] > 0 for r in rows)
