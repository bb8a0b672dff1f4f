"""LoRA in the core: at most max_loras distinct adapters running (the blocked head waits, nobody overtakes it),
and the prefix cache keyed by adapter."""

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.lora_admission import LoRASlotLimit
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest

from .helpers import make_request, step

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def _lora_request(num_prompt_tokens, lora, max_tokens=2, **kw):
    request = make_request(num_prompt_tokens, max_tokens=max_tokens, **kw)
    request.lora_request = lora
    return request


def _scheduler(max_loras, enable_caching=False):
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    return Scheduler(config, KVCacheManager(64, 4, enable_caching), max_loras=max_loras)


def test_limit_counts_distinct_running_adapters():
    limit = LoRASlotLimit(2)
    running = [_lora_request(3, A), _lora_request(3, A), _lora_request(3, None)]
    assert limit.admits(_lora_request(3, B), running)  # a, b: two
    assert not limit.admits(_lora_request(3, C), running + [_lora_request(3, B)])  # a, b, c: three
    assert limit.admits(_lora_request(3, A), running + [_lora_request(3, B)])  # a is already running
    assert limit.admits(_lora_request(3, None), running + [_lora_request(3, B)])  # the base needs no slot


def test_a_new_adapter_waits_at_the_head_and_nobody_overtakes_it():
    sched = _scheduler(max_loras=1)
    a1, b1, a2, base = (_lora_request(4, A, max_tokens=3), _lora_request(4, B), _lora_request(4, A),
                        _lora_request(4, None))
    for r in (a1, b1, a2, base):
        sched.add_request(r)
    out, _ = step(sched)
    # b1 needs a second slot: it waits, and a2 and the base request behind it wait too (strict order)
    assert out.num_scheduled_tokens == {a1.req_id: 4}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {a1.req_id: 1}
    out, _ = step(sched)  # a1's last token: it finishes in this step
    assert out.num_scheduled_tokens == {a1.req_id: 1}
    out, _ = step(sched)  # adapter a's slot is free: b1 first, then everything that fits under b
    assert out.num_scheduled_tokens == {b1.req_id: 4}
    step(sched)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {a2.req_id: 4, base.req_id: 4}


def test_prefix_cache_is_keyed_by_adapter():
    sched = _scheduler(max_loras=3, enable_caching=True)
    first = _lora_request(9, A, max_tokens=1)
    sched.add_request(first)
    step(sched)
    # the same 9 tokens: a hit only under the same adapter (8 = two full blocks; the last token is never cached)
    expected = {"same adapter": (A, 8), "other adapter": (B, 0), "base": (None, 0)}
    for label, (lora, num_cached) in expected.items():
        request = _lora_request(9, lora, max_tokens=1)
        sched.add_request(request)
        out, _ = step(sched)
        assert out.scheduled_new_reqs[0].num_computed_tokens == num_cached, label
        assert out.scheduled_new_reqs[0].lora_request == lora, label
