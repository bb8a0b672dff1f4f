"""The KV disk tier in the engine: evicted prefixes come back from disk (also after a restart) with the same
greedy tokens as recomputing them, and nothing leaks."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.tiny_models import make_hf_model, save_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    model = make_hf_model("llama", seed=5, max_position_embeddings=1024)
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-kv-disk"))


def _prompts():
    rng = random.Random(3)
    prefix = [rng.randrange(3, 512) for _ in range(160)]  # 10 blocks of 16
    first = prefix + [rng.randrange(3, 512) for _ in range(9)]
    again = prefix + [rng.randrange(3, 512) for _ in range(7)]
    fillers = [[rng.randrange(3, 512) for _ in range(120)] for _ in range(4)]
    return first, again, fillers


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _stats(llm: LLM):
    return llm.engine.core.stats()


def test_an_evicted_prefix_is_read_back_and_survives_a_restart(tiny_model_dir, tmp_path):
    first, again, fillers = _prompts()
    small = dict(num_kv_blocks=24, max_num_batched_tokens=256)  # too small for the prefix and a filler at once
    reference = LLM(model=tiny_model_dir, **small)
    expected = [_run(reference, [p])[0] for p in (first, *fillers, again)]
    del reference

    llm = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), **small)
    got = [_run(llm, [p])[0] for p in (first, *fillers, again)]
    assert got == expected
    stats = _stats(llm)
    assert stats.kv_disk_stored_blocks >= 10  # the prefix was evicted by the fillers and spilled
    assert stats.kv_disk_hit_tokens >= 10 * 16  # ... and read back for `again`
    assert llm.engine.core.check_kv_leaks() == []
    llm.engine.core.shutdown()
    del llm

    restarted = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), **small)
    assert _run(restarted, [again])[0] == expected[-1]
    assert _stats(restarted).kv_disk_hit_tokens >= 10 * 16
    assert restarted.engine.core.check_kv_leaks() == []


def test_shutdown_keeps_memory_prefixes_and_another_configuration_never_reads_them(tiny_model_dir, tmp_path):
    first, again, _ = _prompts()
    llm = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), num_kv_blocks=24)
    expected = _run(llm, [first, again])
    llm.engine.core.shutdown()  # the prefix is still in memory: shutdown keeps it on disk
    assert len(list(tmp_path.glob("*/*/*.kv"))) >= 10
    del llm
    other = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), num_kv_blocks=24, kv_cache_dtype="bfloat16")
    _run(other, [again])
    assert _stats(other).kv_disk_hit_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # one folder per fingerprint
    same = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), num_kv_blocks=24)
    assert _run(same, [again, first]) == expected[::-1]
    assert _stats(same).kv_disk_hit_tokens >= 10 * 16


def test_the_disk_tier_refuses_what_it_cannot_serve(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_cache_size"):
        LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), kv_disk_cache_size="0")


class _GatedReads:
    """The disk tier's file reads (KVDiskStore.read_file) held until `event` is set."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, path: Path) -> bytes:
        assert self.event.wait(30), "the reads were never let through"
        return path.read_bytes()


def test_a_prefix_loading_from_disk_does_not_hold_up_a_running_request(tiny_model_dir, tmp_path):
    first, again, fillers = _prompts()
    other = fillers[0][:40]
    long_greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    small = dict(num_kv_blocks=24, max_num_batched_tokens=256)
    reference = LLM(model=tiny_model_dir, **small)
    expected_again = _run(reference, [again])[0]
    expected_other = reference.generate([{"prompt_token_ids": other}], long_greedy, use_tqdm=False)[0].outputs[0].token_ids
    del reference

    llm = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), **small)
    _run(llm, [first, *fillers[1:]])  # the prefix is evicted to disk
    engine, core = llm.engine, llm.engine.core
    assert core.disk_tier.store.num_blocks >= 10
    gate = _GatedReads()
    core.disk_tier.store.read_file = gate
    engine.add_request("other", {"prompt_token_ids": other}, long_greedy)
    engine.step()
    engine.add_request("again", {"prompt_token_ids": again}, GREEDY)
    tokens = {"other": [], "again": []}
    for _ in range(6):  # `again` waits for its blocks; `other` decodes a token every step meanwhile
        outputs = {o.request_id: o for o in engine.step()}
        assert set(outputs) == {"other"}
        tokens["other"] = outputs["other"].outputs[0].token_ids
        assert [r.req_id for r in core.scheduler.loading] == ["again"]
    assert len(tokens["other"]) == 7
    gate.event.set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    assert tokens == {"other": expected_other, "again": expected_again}
    assert core.stats().kv_disk_hit_tokens >= 10 * 16
    assert core.check_kv_leaks() == []


def test_abort_while_a_prefix_is_loading_frees_every_block(tiny_model_dir, tmp_path):
    first, again, fillers = _prompts()
    llm = LLM(model=tiny_model_dir, kv_disk_cache=str(tmp_path), num_kv_blocks=24, max_num_batched_tokens=256)
    _run(llm, [first, *fillers])
    engine, core = llm.engine, llm.engine.core
    gate = _GatedReads()
    core.disk_tier.store.read_file = gate
    engine.add_request("again", {"prompt_token_ids": again}, GREEDY)
    engine.step()
    assert [r.req_id for r in core.scheduler.loading] == ["again"]
    engine.abort_request("again")
    assert not engine.has_unfinished_requests() and core.check_kv_leaks() == []
    gate.event.set()
    assert _run(llm, [again])  # the late reads land nowhere; the prefix is found again
    assert core.check_kv_leaks() == []
