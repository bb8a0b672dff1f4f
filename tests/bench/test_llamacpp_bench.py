"""`bench llamacpp` without llama-server: the random-weight GGUF it writes loads in pagedllm with the
shape asked for, its header gives the bench the right shapes, the table's ratios, and a clear refusal
when the llama-server binary is missing."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.bench.cli_llamacpp import gguf_shapes, llamacpp_table
from pagedllm.bench.random_gguf import SHAPES, WEIGHT_STD, write_random_gguf


@pytest.fixture(scope="module")
def write_tiny(tmp_path_factory):
    """qtype -> (path, qtype) of a tiny random GGUF, written once per module."""
    written = {}

    def write(qtype: str):
        if qtype not in written:
            path = tmp_path_factory.mktemp("gguf") / f"tiny-{qtype}.gguf"
            written[qtype] = (write_random_gguf(path, "tiny", qtype), qtype)
        return written[qtype]

    return write


@pytest.mark.slow  # gguf's reader takes ~20 s over the 100 K tokenizer strings on a loaded 2-core machine
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_random_gguf_has_the_shape_quant_type_and_scale_asked_for(write_tiny, qtype):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    path, _ = write_tiny(qtype)
    s = SHAPES["tiny"]
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 9 * s.layers + 1  # embedding, 7 weights + 2 norms a layer, final norm
    q = tensors["blk.1.ffn_down.weight"]
    assert q.tensor_type == GGMLQuantizationType[qtype] and list(q.shape) == [s.intermediate, s.hidden]
    w = dequantize(q.data, q.tensor_type)
    assert abs(w.std() - WEIGHT_STD) < 0.2 * WEIGHT_STD and abs(w.mean()) < 0.1 * WEIGHT_STD
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152  # the embedded model's vocabulary

    shapes = gguf_shapes(path)
    kv_dim = s.kv_heads * s.hidden // s.heads
    assert shapes["layers"] == s.layers and shapes["vocab_size"] == 49152
    assert shapes["kv_elements_per_token"] == s.layers * 2 * kv_dim
    assert shapes["weights"]["blk.0.attn_k.weight"] == (kv_dim, s.hidden)
    assert shapes["weights"]["output.weight"] == (49152, s.hidden)  # tied: the LM head is the embedding
    assert "token_embd.weight" not in shapes["weights"] and len(shapes["weights"]) == 7 * s.layers + 1


@pytest.mark.slow
def test_pagedllm_loads_the_random_gguf_quantized(write_tiny, tmp_path, monkeypatch):
    """Q4_0 (Q8_0 goes through the same loader path)."""
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    from pagedllm.model.loader import load_model

    path, _ = write_tiny("Q4_0")
    loaded = load_model(str(path))
    s = SHAPES["tiny"]
    cfg = loaded.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, 49152)
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 49152
    float32_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters() if p.dtype.is_floating_point)
    assert float32_bytes < 4 * (s.hidden * 49152) / 2, "the weights were inflated to float32"


def test_the_bench_refuses_clearly_when_llama_server_is_missing(tmp_path):
    from pagedllm.bench.cli import run_bench
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "llamacpp", "--llama-server", str(tmp_path / "nope"),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="llama-server is not built: .*scripts/build_llama_server.sh"):
        run_bench(args)


def test_the_table_gives_each_measure_and_the_ratio():
    def rounds(*rates):
        return [{"output_tok_s": r} for r in rates]

    mem = {"pagedllm": {"peak_mib_total": 900.0, "peak_mib_largest": 500.0},
           "llama.cpp": {"peak_mib_total": 250.0, "peak_mib_largest": 250.0}}
    result = {"rounds": 3, "concurrency": 64, "concurrent_rounds": 1, "file_mib": 100.0, "threads": 2,
              "prompt_len": 128, "output_len": 256, "pagedllm_kv_mib": 150.0, "llama_kv_mib": 75.0,
              "single": {"pagedllm": rounds(30, 50, 40), "llama.cpp": rounds(20, 21, 19)},
              "concurrent": {"pagedllm": rounds(300), "llama.cpp": rounds(200)}, "memory": mem,
              "float32_matmuls": {"step_s": 0.025, "bound_tok_s": 40.0},
              "ttft_prompt_len": 1024, "ttft": {"pagedllm": [{"latency_s_mean": 2.0}, {"latency_s_mean": 3.0},
                                                             {"latency_s_mean": 4.0}],
                                                "llama.cpp": [{"latency_s_mean": 6.0}] * 3},
              "llama_slots": {"one_user": 1, "at_once": 64},
              "weights_held": {"bytes": 105 * 2**20, "file_bytes": 100 * 2**20},
              "read_bandwidth": {"gb_s": 10.0}, "weight_bytes_per_token": 250_000_000}
    table = llamacpp_table(result)
    assert "| single user, output tok/s (median of 3 rounds) | 40.0 | 20.0 | 2.00x |" in table
    assert "| single user, output tok/s (best round) | 50.0 | 21.0 | 2.38x |" in table
    assert "| 64 at once, output tok/s (median of 1) | 300.0 | 200.0 | 1.50x |" in table
    assert "| peak resident MiB, largest process (pagedllm: its engine core) | 500 | 250 | 2.00x |" in table
    assert "(file + its KV cache): 2.00x; all its processes: 3.60x" in table
    assert "/ that bound: 1.00x" in table
    assert "| time to first token, 1024-token prompt, s (median) | 3.00 | 6.00 | 0.50x |" in table
    assert "--parallel 1 for one user and the time to first token, --parallel 64 for 64 at once" in table
    assert "Weights held by pagedllm: 105 MiB, 1.05x the file." in table
    assert "a one-user bound of 40.0 tok/s; pagedllm reaches 1.00 of it, llama.cpp 0.50." in table
    assert "one at a time" not in table
    assert "The servers ran one at a time" in llamacpp_table(dict(result, one_at_a_time=True))
    assert not np.isnan(result["float32_matmuls"]["bound_tok_s"])


def test_a_file_the_machine_cannot_hold_twice_runs_one_server_at_a_time():
    from pagedllm.bench.llamacpp_phases import fits_twice

    gib = 2**30
    assert fits_twice(1 * gib, 8 * gib) and fits_twice(1 * gib, None)
    assert not fits_twice(17 * gib, 22 * gib)  # the 30B-A3B-shaped Q4_K_M file on a 24 GB machine


@pytest.mark.slow  # gguf's reader over the tokenizer
def test_a_decode_step_reads_the_active_share_of_the_experts(tmp_path):
    from gguf import GGUFReader

    path = write_random_gguf(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q4_K_M")
    s = SHAPES["tiny-qwen3moe"]
    tensors = GGUFReader(str(path)).tensors
    experts = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 3)
    dense = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    shapes = gguf_shapes(path)
    assert shapes["weight_bytes_per_token"] == dense + experts * s.experts_used // s.experts
    assert shapes["kv_elements_per_token"] == s.layers * 2 * s.kv_heads * s.head_dim  # head_dim 64 from the file


@pytest.mark.slow  # both servers started on a tiny Qwen3-MoE file, one at a time
def test_both_servers_serve_the_moe_file_one_at_a_time(tmp_path, monkeypatch):
    from pagedllm.bench.llamacpp import llama_server_binary
    from pagedllm.entrypoints.cli import build_parser

    binary = llama_server_binary()
    if not binary.is_file():
        pytest.skip("llama-server not built (scripts/build_llama_server.sh)")
    path = write_random_gguf(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q4_K_M")
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    args = build_parser().parse_args(
        ["bench", "llamacpp", "--model", str(path), "--llama-server", str(binary), "--one-at-a-time", "--rounds", "1",
         "--output-len", "4", "--prompt-len", "16", "--concurrency", "2", "--ttft-prompt-len", "0",
         "--no-matmul-bound", "--no-weights-held", "--threads", "1", "--out", str(tmp_path / "out")])
    result = args.run(args, {})
    assert result["one_at_a_time"]
    for phase in ("single", "concurrent"):
        assert set(result[phase]) == {"pagedllm", "llama.cpp"}
        assert all(r["output_tok_s"] > 0 for rounds in result[phase].values() for r in rounds)
    assert result["memory"]["pagedllm"]["num_processes"] >= 2  # the API server and its engine core
    assert result["memory"]["llama.cpp"]["peak_mib_total"] > 0


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_both_servers_serve_a_random_q5_file(qtype, tmp_path, monkeypatch):
    """--random-qtype Q5_0 / Q5_1: the file written directly, read by llama-server and by pagedllm."""
    from pagedllm.bench.llamacpp import llama_server_binary
    from pagedllm.entrypoints.cli import build_parser

    binary = llama_server_binary()
    if not binary.is_file():
        pytest.skip("llama-server not built (scripts/build_llama_server.sh)")
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    args = build_parser().parse_args(
        ["bench", "llamacpp", "--random-shape", "tiny", "--random-qtype", qtype, "--llama-server", str(binary),
         "--one-at-a-time", "--rounds", "1", "--output-len", "4", "--prompt-len", "16", "--concurrency", "0",
         "--ttft-prompt-len", "0", "--no-matmul-bound", "--no-weights-held", "--threads", "1",
         "--out", str(tmp_path / "out")])
    result = args.run(args, {})
    assert set(result["single"]) == {"pagedllm", "llama.cpp"}
    assert all(r["output_tok_s"] > 0 for rounds in result["single"].values() for r in rounds)
