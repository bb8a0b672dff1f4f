"""Priority scheduling through the offline API with a real (tiny) model: priorities change when requests run,
never what they generate."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InvalidRequestError
from tests.engine.tiny_llama_dir import build_tiny_llama_dir

PROMPTS = ["The capital of France is", "One, two, three,", "Once upon a time", "def fib(n):",
           "Roses are red,", "The quick brown fox"]
PRIORITIES = [3, 0, 2, 0, 1, -1]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-prio"), initializer_range=0.3))


@pytest.fixture(scope="module")
def solo_outputs(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_greedy_outputs_under_priority_and_preemption_equal_solo_runs(model_dir, solo_outputs):
    # 12 blocks of 4 tokens for six ~30-token sequences: requests are preempted and recomputed.
    llm = LLM(model_dir, scheduling_policy="priority", block_size=4, num_kv_blocks=12, max_model_len=256)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=PRIORITIES)
    assert [o.prompt for o in outputs] == PROMPTS  # input order, whatever the run order
    assert [o.outputs[0].token_ids for o in outputs] == solo_outputs
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.core.kv_cache_manager.check_no_leaks() == []


def test_first_tokens_come_in_priority_order_then_arrival(model_dir, solo_outputs):
    engine = LLMEngine(EngineArgs(model=model_dir, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=64,
                                  max_model_len=256))
    for i, (prompt, priority) in enumerate(zip(PROMPTS, PRIORITIES)):
        engine.add_request(str(i), prompt, GREEDY, priority=priority)
    first_token_order, finished = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id not in first_token_order and output.outputs[0].token_ids:
                first_token_order.append(output.request_id)
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    # priorities [3, 0, 2, 0, 1, -1]: -1 first, then the two 0s in arrival order, 1, 2, 3
    assert first_token_order == ["5", "1", "3", "4", "2", "0"]
    assert [finished[str(i)] for i in range(len(PROMPTS))] == solo_outputs


def test_priority_is_refused_under_fcfs_and_checked(model_dir):
    llm = LLM(model_dir, num_kv_blocks=16, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="priority must be 0 .*--scheduling-policy priority"):
        llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[1])
    assert not llm.engine.has_unfinished_requests()
    # priority 0 is every request's default: accepted under fcfs
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[0])[0].finished
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["Hi", "there"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(InvalidRequestError, match="priority must be a 64-bit integer"):
        llm.engine.add_request("x", "Hi", GREEDY, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        EngineArgs(scheduling_policy="lifo")
