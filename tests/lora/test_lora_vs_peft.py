"""LoRA adapters made by peft: pagedllm's greedy outputs equal HF + PEFT's token for token, per adapter,
alone and mixed in one batch with the base model, under chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, LoRARequest
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, load_peft_reference, make_adapter
from tests.model.tiny_models import make_hf_model, save_hf_model

pytest.importorskip("peft")

MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = [3, 17, 40, 70]
ADAPTERS = {  # name -> (id, rank, alpha, targets, rsLoRA)
    "r8-all": (1, 8, 16, ALL_PROJECTIONS, False),
    "r4-all-rslora": (2, 4, 8, ALL_PROJECTIONS, True),
    "r8-qv-down": (3, 8, 32, ["q_proj", "v_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # Heads of 32 (not the tiny models' 16): the compiled attention and the fused decoder step take this
    # model, adapter rows included (their deltas added by lora_sgmv_cpu inside the fused call).
    base = make_hf_model("llama", seed=3, max_position_embeddings=512, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32)
    base.generation_config.eos_token_id = None
    model_path = save_hf_model(base, tmp_path_factory.mktemp("base"))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, base.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    references = {None: [hf_greedy(base, p, MAX_NEW_TOKENS) for p in prompts]}
    loras = {}
    for seed, (name, (lora_id, rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(base, tmp_path_factory.mktemp(name), rank=rank, alpha=alpha, target_modules=targets,
                            seed=seed, use_rslora=rslora)
        loras[name] = LoRARequest(name, lora_id, path)
        peft_model = load_peft_reference(base, path)
        references[name] = [hf_greedy(peft_model, p, MAX_NEW_TOKENS) for p in prompts]
        # the test can fail: each adapter changes what the model says
        assert [r.token_ids for r in references[name]] != [r.token_ids for r in references[None]], name
    return model_path, prompts, loras, references


def _check(llm, prompts, batch: list[str | None], loras, references, label) -> None:
    """Generate every (prompt, adapter) of `batch` in one generate call; each equals its HF + PEFT reference."""
    jobs = [(p, i, name) for name in batch for i, p in enumerate(prompts)]
    lora_requests = [None if name is None else loras[name] for _, _, name in jobs]
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _, _ in jobs], params, use_tqdm=False,
                           lora_request=lora_requests)
    verdicts = []
    for (prompt, i, name), out in zip(jobs, outputs):
        completion = out.outputs[0]
        logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
        verdicts.append(assert_matches_reference(completion.token_ids, logprobs, references[name][i],
                                                 f"{label}: adapter {name}, prompt of {len(prompt)} tokens"))
    assert verdicts.count("exact") >= len(verdicts) - 1, verdicts
    assert llm.engine.core.check_kv_leaks() == []


COMMON = dict(enable_lora=True, max_lora_rank=8, enable_prefix_caching=True, max_num_batched_tokens=29,
              block_size=4)


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_each_adapter_alone_matches_peft(setup, name):
    model_path, prompts, loras, references = setup
    llm = LLM(model=model_path, max_loras=1, **COMMON)
    _check(llm, prompts, [name], loras, references, "alone")


def test_three_adapters_and_base_in_one_batch_match_peft(setup, monkeypatch):
    """Every adapter resident at once (max_loras=3): steps mix three adapters and the base; the same
    prompts under each adapter share no cached prefix; run twice so the second run hits the prefix cache.
    Where the compiled library is built, adapted steps take the fused decoder call."""
    from pagedllm.lora.layers import current_segments
    from pagedllm.model.attention import cpu_op
    from pagedllm.model.layers import fused_decoder

    fused_with_segments = []
    real_call = fused_decoder.FusedDecoder.__call__

    def counted(decoder, *args):
        fused_with_segments.append(len(current_segments()) // 3)
        return real_call(decoder, *args)

    monkeypatch.setattr(fused_decoder.FusedDecoder, "__call__", counted)
    model_path, prompts, loras, references = setup
    llm = LLM(model=model_path, max_loras=3, **COMMON)
    batch = [None, *ADAPTERS]
    steps_with = []
    llm.engine.core.step_listeners.append(
        lambda sched, _: steps_with.append(len({r.lora_request for r in _new_and_running(llm, sched)})))
    _check(llm, prompts, batch, loras, references, "mixed")
    _check(llm, prompts, batch, loras, references, "mixed, prefix cache warm")
    assert max(steps_with) == 4, "some step should have run the base and all three adapters together"
    if cpu_op.load():
        assert max(fused_with_segments) == 3, "a step of three adapters' segments should have run fused"


def test_mixed_batch_with_preemption_and_slot_eviction_matches_peft(setup):
    """Fewer slots than adapters (max_loras=2, max_cpu_loras=2: adapters are evicted from their slots and
    re-read from disk) and a KV cache small enough to preempt."""
    model_path, prompts, loras, references = setup
    llm = LLM(model=model_path, **{**COMMON, "max_loras": 2, "max_cpu_loras": 2, "num_kv_blocks": 40})
    steps_with = []
    llm.engine.core.step_listeners.append(
        lambda sched, _: steps_with.append(len({r.lora_request for r in _new_and_running(llm, sched)} - {None})))
    _check(llm, prompts, [None, *ADAPTERS], loras, references, "preempted")
    assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert max(steps_with) == 2, steps_with  # the scheduler never ran more adapters in one step than slots


def _new_and_running(llm, sched):
    return [llm.engine.core.scheduler.requests[r] for r in sched.num_scheduled_tokens
            if r in llm.engine.core.scheduler.requests]


@pytest.mark.slow  # a second worker process
def test_tensor_parallel_shards_adapters_as_their_layers_and_matches_peft(setup):
    """tp=2 on a model of 2 query heads and 1 KV head: q rows of B split, k/v rows replicated (as the KV head
    is), gate/up rows split, o/down columns of A split; all three adapters and the base in one batch."""
    model_path, prompts, loras, references = setup
    llm = LLM(model=model_path, tensor_parallel_size=2, max_loras=3, **COMMON)
    try:
        _check(llm, prompts, [None, *ADAPTERS], loras, references, "tp=2")
    finally:
        llm.engine.core.shutdown()
