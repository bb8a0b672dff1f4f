"""Triton attention kernels under Triton's interpreter (CPU) against the PyTorch reference.

Run by ``test_triton_attention.py`` in a fresh interpreter with TRITON_INTERPRET=1 (triton
decides interpret-or-compile when a function is decorated, and by the time other tests ran,
transformers has already imported triton in compile mode). Directly:
``TRITON_INTERPRET=1 pytest tests/model/triton_interpreter_cases.py``.

float32 throughout; the relative error (max |out - ref| / max |ref|) must stay under 1e-5.
Tiles are kept small (16) so that short sequences still span several key tiles, and the
split-K path is forced explicitly.
"""

import importlib.util
import math

import pytest
import torch

from pagedllm.model.attention.paged import paged_attention, write_kv_cache
from tests.model.paged_kv_helpers import PagedRunner, build_metadata

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the 'triton' package is not installed"
)

MAX_REL_ERR = 1e-5


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sum, InterpretedFunction):
            pytest.fail("triton was imported without TRITON_INTERPRET=1; run this file through "
                        "test_triton_attention.py or with TRITON_INTERPRET=1 set from the start")
        yield


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel < MAX_REL_ERR, f"relative error {rel:.2e}"


def make_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A cache whose block tables are shuffled, with every sequence's K/V already written."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # garbage around
    full = build_metadata(tables, seq_lens, seq_lens, block_size)
    num_tokens = sum(seq_lens)
    write_kv_cache(torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
                   torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen), kv_cache, full.slot_mapping)
    metadata = build_metadata(tables, seq_lens, query_lens, block_size)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return query, kv_cache, metadata


# --- KV write ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 4), (3, 24, 5), (1, 8, 16)])
def test_write_kv_cache_matches_reference(num_kv_heads, head_dim, block_size):
    from pagedllm.model.attention.triton_kv_write import triton_write_kv_cache

    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 17
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # K/V as the model produces them: non-contiguous views into one fused projection.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    ref = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    out = ref.clone()
    write_kv_cache(key, value, ref, slots)
    triton_write_kv_cache(key, value, out, slots)
    assert torch.equal(out, ref)


def test_write_kv_cache_skips_negative_slots():
    from pagedllm.model.attention.triton_kv_write import triton_write_kv_cache

    cache = torch.zeros(2, 2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    triton_write_kv_cache(key, 2 * key, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(2, 8, 8)
    assert flat[0, 5].eq(1).all() and flat[1, 0].eq(2).all()
    assert flat[:, [1, 2, 3, 4, 6, 7]].eq(0).all()


# --- decode ------------------------------------------------------------------------------------

DECODE_CASES = {
    # name: (seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    "gqa_mid_block": ([37, 5, 16, 50], 4, 2, 16, 4),
    "seq_len_1": ([1, 1, 9], 4, 2, 16, 4),
    "mqa_odd_block_size": ([23, 41], 6, 1, 16, 5),
    "mha_non_pow2_head_dim": ([33, 7], 3, 3, 24, 16),
}


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(case, num_splits):
    from pagedllm.model.attention.triton_decode import triton_paged_decode

    seq_lens, num_heads, num_kv_heads, head_dim, block_size = DECODE_CASES[case]
    query, kv_cache, metadata = make_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    ref = paged_attention(query, kv_cache, metadata, scale)
    out = triton_paged_decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                              num_splits=num_splits, block_n=16)
    assert_matches(out, ref)


def test_decode_split_k_with_more_splits_than_tiles():
    """Long and short sequences together: splits past a short sequence's end are empty."""
    from pagedllm.model.attention.triton_decode import triton_paged_decode

    query, kv_cache, metadata = make_case([70, 3, 1], [1, 1, 1], 4, 2, 16, 8, seed=3)
    ref = paged_attention(query, kv_cache, metadata, 0.25)
    out = triton_paged_decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, 0.25,
                              num_splits=8, block_n=16)
    assert_matches(out, ref)


def test_default_num_splits():
    from pagedllm.model.attention.triton_decode import default_num_splits

    assert default_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1  # SMs busy
    assert default_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=200, num_sms=132) == 1  # too short
    assert default_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 16
    assert default_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 4


# --- prefill / chunked prefill -----------------------------------------------------------------

PREFILL_CASES = {
    # name: (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
    "full_prompts": ([37, 5, 20], [37, 5, 20], 4, 2, 16, 4),
    "chunk_over_cached_prefix": ([45, 30], [13, 17], 4, 2, 16, 4),
    "mixed_with_decode_rows": ([40, 1, 19, 26], [22, 1, 1, 26], 4, 1, 16, 5),
    "mha_non_pow2_head_dim": ([18, 35], [18, 9], 2, 2, 24, 16),
}


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_reference(case):
    from pagedllm.model.attention.triton_prefill import triton_paged_prefill

    seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size = PREFILL_CASES[case]
    query, kv_cache, metadata = make_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    ref = paged_attention(query, kv_cache, metadata, scale)
    out = triton_paged_prefill(query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                               metadata.max_query_len, scale, block_m=16, block_n=16)
    assert_matches(out, ref)


# --- through a model: backend selection and the CUDA-graph-style padded decode ---------------------


def test_model_with_triton_backend_matches_torch_backend():
    """A tiny GQA Llama: prefill, chunked prefill and decode steps, triton vs torch backend."""
    from pagedllm.model.attention.backend import TORCH_BACKEND, TritonAttentionBackend
    from pagedllm.model.attention.layer import set_attention_backend
    from pagedllm.model.llama import LlamaForCausalLM
    from tests.model.tiny_models import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama")).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    steps = [
        [(0, list(range(1, 12))), (1, list(range(40, 45)))],  # prefill two prompts
        [(0, [7]), (1, list(range(50, 60)))],  # decode + a chunk over a cached prefix
        [(0, [8]), (1, [9])],  # decode only
    ]
    logits = {}
    for name in ("torch", "triton"):
        backend = TritonAttentionBackend(block_n=16, block_m=16) if name == "triton" else TORCH_BACKEND
        set_attention_backend(model, backend)
        runner = PagedRunner(model, num_blocks=16, block_size=4)
        logits[name] = [runner.step(chunks) for chunks in steps]
    for ref, out in zip(logits["torch"], logits["triton"]):
        assert_matches(out, ref)


def test_padded_decode_buffers_match_eager_decode():
    """The CUDA-graph decode path (static buffers padded to a bucket; here run eagerly) changes nothing."""
    from pagedllm.model.attention.backend import TritonAttentionBackend
    from pagedllm.model.attention.layer import set_attention_backend
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.model.forward_context import set_forward_context
    from pagedllm.worker.gpu import DecodeGraphRunner, graph_batch_sizes
    from tests.model.tiny_models import tiny_config

    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama")).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    set_attention_backend(model, TritonAttentionBackend(block_n=16))
    runner = PagedRunner(model, num_blocks=24, block_size=4)
    runner.step([(0, list(range(1, 10))), (1, list(range(20, 26))), (2, [3])])  # prefill three
    graphs = DecodeGraphRunner(model, runner.kv_caches, max_num_seqs=8, max_model_len=64, block_size=4,
                               device=torch.device("cpu"), capture=False)

    # One decode step for the three sequences, as the model runner would build it.
    tables = [runner.tables[i] + [runner.free_blocks.pop()] * (i == 2) for i in range(3)]
    seq_lens = [10, 7, 2]
    metadata = build_metadata(tables, seq_lens, [1, 1, 1], 4)
    input_ids, positions = torch.tensor([5, 6, 7]), torch.tensor(seq_lens) - 1
    kv_before = [cache.clone() for cache in runner.kv_caches]
    with torch.no_grad():
        padded = graphs.run(input_ids, positions, metadata)  # pads 3 -> bucket 4
        kv_padded = [cache.clone() for cache in runner.kv_caches]
        for cache, before in zip(runner.kv_caches, kv_before):
            cache.copy_(before)
        with set_forward_context(metadata, runner.kv_caches):
            eager = model(input_ids, positions)
    assert padded.shape == eager.shape
    assert_matches(padded, eager)
    # Padding rows wrote no KV: every slot but the three real ones is bit-identical. The real slots hold
    # K/V projected in a batch of 4 rows instead of 3, which the GEMM may sum in another order.
    real = torch.zeros(runner.kv_caches[0].shape[1] * 4, dtype=torch.bool)
    real[metadata.slot_mapping] = True
    for a, b in zip(kv_padded, runner.kv_caches):
        a_slots, b_slots = a.flatten(1, 2), b.flatten(1, 2)  # [2, num_slots, heads, dim]
        assert torch.equal(a_slots[:, ~real], b_slots[:, ~real])
        torch.testing.assert_close(a_slots[:, real], b_slots[:, real], rtol=1e-5, atol=1e-5)


def test_decode_float16_within_half_precision():
    """Low-precision caches take the cast paths (bf16 is not checked here: the interpreter's bf16 tl.dot is wrong)."""
    from pagedllm.model.attention.triton_decode import triton_paged_decode

    query, kv_cache, metadata = make_case([37, 5, 16], [1, 1, 1], 4, 2, 16, 4, seed=5)
    ref = paged_attention(query, kv_cache, metadata, 0.25)
    out = triton_paged_decode(query.half(), kv_cache.half(), metadata.block_tables, metadata.seq_lens, 0.25,
                              num_splits=2, block_n=16)
    assert out.dtype == torch.float16
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 5e-3


def test_engine_greedy_outputs_identical_with_triton_backend(tmp_path):
    """Through the whole engine (chunked prefill, decode, one step budget of 32 tokens)."""
    from pagedllm import LLM, SamplingParams
    from tests.model.tiny_models import make_hf_model, save_hf_model

    model_dir = save_hf_model(make_hf_model("llama", seed=3), tmp_path / "tiny")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (45, 9, 1)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=model_dir, attention_backend=backend, max_num_batched_tokens=32, num_kv_blocks=32,
                  device="cpu")
        assert llm.engine.core.executor.runner.attn_backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["triton"] == outputs["torch"]
