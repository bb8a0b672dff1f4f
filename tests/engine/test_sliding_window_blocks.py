"""A long conversation on a tiny Mistral whose every layer has a 16-token window (tests/model/tiny_models.py):
the engine frees the blocks behind the window, holds no more than the window needs at any step, and
still matches Hugging Face's greedy outputs token for token (logprobs within 1e-3).

The bound (core/kv_cache_manager.py): a step writing C slots from position n holds the blocks of positions
max(0, n - W + 1) .. n + C - 1, at most ceil((W - 1 + C) / block_size) + 1; for a decode step (C = 1) with
W = 16 and blocks of 4 that is ceil(16 / 4) + 1 = 5 blocks, where the table spans up to 35 (140 tokens).
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import BeamSearchParams
from pagedllm.core.kv_cache_interface import paged_kv_cache_manager, plugged_kv_cache_manager
from pagedllm.core.kv_cache_manager import cdiv
from tests.engine.test_beam_search import assert_same_beams, hf_beam_search
from tests.hf_reference import assert_matches_reference, hf_greedy
from tests.model.conftest import require_compiled_cpu_ops
from tests.model.tiny_models import WINDOW, make_hf_model, save_hf_model

BLOCK_SIZE = 4
NEW_TOKENS = 100
PROMPT_LENGTHS = [40, 33, 70]  # each longer than twice the window; the longest ends at 170 tokens > 8 windows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf_model = make_hf_model("mistral_window", seed=1, max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    assert hf_model.config.sliding_window == WINDOW
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("mistral_window"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf_model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return path, prompts, [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


class BlockWatch:
    """After each step's scheduling: the blocks each scheduled request holds, against the bound."""

    def __init__(self, llm) -> None:
        self.kv = llm.engine.core.kv_cache_manager
        self.max_decode_blocks = 0
        self.max_table_len = 0
        llm.engine.core.step_listeners.append(self)

    def __call__(self, sched_output, runner_output) -> None:
        for req_id, num in sched_output.num_scheduled_tokens.items():
            held = self.kv.num_live_blocks(req_id)
            assert held <= cdiv(WINDOW - 1 + num, BLOCK_SIZE) + 1, f"{req_id} holds {held} blocks for {num} slots"
            self.max_table_len = max(self.max_table_len, len(self.kv.get_block_ids(req_id)))
            if num == 1:
                self.max_decode_blocks = max(self.max_decode_blocks, held)


def _check(llm, prompts, references, label, n=1):
    params = SamplingParams(n=n, temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, ref, out in zip(prompts, references, outputs):
        assert len(out.outputs) == n
        for completion in out.outputs:
            logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
            assert assert_matches_reference(completion.token_ids, logprobs, ref,
                                            f"{label}, prompt of {len(prompt)}") == "exact"
    assert llm.engine.core.check_kv_leaks() == []
    return outputs


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="one-batch"),
        # the reference gathers whole tables: the null entries read as the never-written (zero) block, masked
        pytest.param(dict(attention_backend="torch"), id="one-batch-torch-reference"),
        pytest.param(dict(max_num_batched_tokens=13), id="chunked-prefill"),
        # rollbacks move num_computed_tokens back, never below its value when the step was scheduled
        pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
                     id="speculative-ngram"),
        pytest.param(dict(num_kv_blocks=13, max_num_batched_tokens=24), id="preemption-recompute"),
        pytest.param(dict(num_kv_blocks=13, max_num_batched_tokens=24, preemption_mode="swap",
                          swap_space="4MiB", enable_prefix_caching=False), id="preemption-swap"),
    ],
)
def test_long_conversation_holds_only_the_window_and_matches_hf(setup, engine_kwargs):
    path, prompts, references = setup
    if "attention_backend" not in engine_kwargs:
        require_compiled_cpu_ops()
    llm = LLM(model=path, block_size=BLOCK_SIZE, **engine_kwargs)
    kv = llm.engine.core.kv_cache_manager
    assert kv.sliding_window == WINDOW
    backend = llm.engine.core.executor.runner.attn_backend.name
    assert backend == engine_kwargs.get("attention_backend", "cpu"), backend  # the compiled op by default
    watch = BlockWatch(llm)
    _check(llm, prompts, references, str(engine_kwargs))
    assert watch.max_decode_blocks == cdiv(WINDOW, BLOCK_SIZE) + 1  # reached, never passed
    assert watch.max_table_len == cdiv(max(PROMPT_LENGTHS) + NEW_TOKENS - 1, BLOCK_SIZE)  # 170 tokens' worth
    if "speculative_config" in engine_kwargs:
        assert llm.engine.core.stats().spec_num_draft_tokens > 0, "the run was meant to speculate"
    if "num_kv_blocks" in engine_kwargs:  # 12 usable blocks: three 5-block windows do not fit side by side
        assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
        assert llm.engine.core.scheduler.num_swap_outs > 0 or engine_kwargs.get("preemption_mode") != "swap"


def test_prefix_hits_and_parallel_samples_with_freed_blocks(setup):
    """A second pass over the same prompts hits the cached blocks of each prompt's last window (the blocks
    before it may have been evicted: no hit needs them); n = 2 greedy samples share the null entries."""
    path, prompts, references = setup
    llm = LLM(model=path, block_size=BLOCK_SIZE, max_num_batched_tokens=13, enable_prefix_caching=True)
    watch = BlockWatch(llm)
    _check(llm, prompts, references, "first pass")
    outputs = _check(llm, prompts, references, "second pass, from the prefix cache", n=2)
    assert all(out.num_cached_tokens >= len(p) - BLOCK_SIZE for out, p in zip(outputs, prompts)), \
        [out.num_cached_tokens for out in outputs]
    assert watch.max_decode_blocks == cdiv(WINDOW, BLOCK_SIZE) + 1


def test_without_freeing_the_table_is_held_whole(setup):
    """The same run on a manager that frees nothing (the factory without the window) holds every block:
    what freeing saves. Outputs are the same."""
    path, prompts, references = setup
    with plugged_kv_cache_manager(paged_kv_cache_manager):
        llm = LLM(model=path, block_size=BLOCK_SIZE)
    kv = llm.engine.core.kv_cache_manager
    assert kv.sliding_window is None
    held = []
    llm.engine.core.step_listeners.append(lambda out, _: held.append(kv.kv_stats().num_used_blocks))
    _check(llm, prompts, references, "no freeing")
    assert max(held) == sum(cdiv(n + NEW_TOKENS - 1, BLOCK_SIZE) for n in PROMPT_LENGTHS)


def test_beam_search_with_freed_blocks_matches_hf(setup):
    """Beams fork the table (null entries included) and copy-on-write their partial last block; the same
    beams and scores as HF's generate(num_beams=3) over a window that slides as they grow."""
    path, prompts, _ = setup
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(model=path, block_size=BLOCK_SIZE)
    watch = BlockWatch(llm)
    params = BeamSearchParams(3, max_tokens=40, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], params)
    assert llm.engine.core.check_kv_leaks() == []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        hf_tokens, hf_scores = hf_beam_search(hf_model, prompt, params, [0])
        assert_same_beams(output, hf_tokens, hf_scores, params.length_penalty, f"windowed beams, prompt {i}")
    assert watch.max_decode_blocks == cdiv(WINDOW, BLOCK_SIZE) + 1


@pytest.mark.slow  # tensor-parallel ranks in worker processes
def test_tensor_parallel_ranks_report_the_window(setup):
    """The ranks (the torch reference, gathering null entries as zeros) agree with HF with the blocks freed."""
    path, prompts, references = setup
    llm = LLM(model=path, block_size=BLOCK_SIZE, tensor_parallel_size=2, max_num_batched_tokens=13)
    try:
        assert llm.engine.core.kv_cache_manager.sliding_window == WINDOW
        watch = BlockWatch(llm)
        _check(llm, prompts[:2], references[:2], "tensor parallel 2")
        assert watch.max_decode_blocks == cdiv(WINDOW, BLOCK_SIZE) + 1
    finally:
        llm.engine.core.shutdown()
