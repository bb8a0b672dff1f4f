"""Speculative proposals in the scheduler, with a fake runner that keeps a model of the KV cache.

The fake runner writes, for every scheduled position, the token it carries (a real token or a
proposal) into the slot the block tables name, applies swaps and copy-on-write copies as the real
runner does, and accepts a random prefix of each request's proposals. After every step:
- a proposal is never written into a shared block (ref_cnt > 1) nor one registered in the prefix
  cache; a real token only when it is the token the block is registered with (a request completing
  a block that another request's prefix hit shares in the same step: the KV is written before any
  attention reads it);
- every computed position of every running request holds that request's real token (a rejected
  proposal never counts as computed);
- every block registered in the prefix cache holds exactly its registered tokens;
- blocks are never leaked or double counted (the existing invariants), and nothing leaks at the end.
"""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import EngineCoreRequest, Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.spec_planner import NgramProposer
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import _check_block_invariants

BLOCK_SIZE = 4
DRAFT_DIR = str(Path(__file__).parent)
"""Any existing path: the draft model is the runner's business, the scheduler only counts its slots."""


class FakeKVRunner:
    """Tokens in slots instead of K and V: what the real runner would leave in the cache."""

    def __init__(self, sched: Scheduler, rng: random.Random, alphabet: int) -> None:
        self.sched = sched
        self.rng = rng
        self.alphabet = alphabet
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.num_accepted = 0
        self.num_rejected = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        kv = self.sched.kv
        for device, host in out.swap_out:
            self.host[host] = list(self.device.get(device, [None] * BLOCK_SIZE))
        for host, device in out.swap_in:
            self.device[device] = list(self.host[host])
        for src, dst in out.block_copies:
            self.device[dst] = list(self.device.get(src, [None] * BLOCK_SIZE))
        sampled: dict[str, list[int]] = {}
        drafted: dict[str, list[int]] = {}  # draft_model: the runner makes the proposals
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.sched.requests[req_id]
            proposals = out.scheduled_spec_tokens.get(req_id, [])
            if req_id in out.num_draft_tokens:
                assert not proposals
                proposals = drafted[req_id] = [self.rng.randrange(3, 3 + self.alphabet)
                                               for _ in range(out.num_draft_tokens[req_id])]
            start = request.num_computed_tokens - num
            tokens = request.all_token_ids[start:start + num - len(proposals)] + proposals
            assert len(tokens) == num
            blocks = kv.req_to_blocks[req_id]
            num_real = num - len(proposals)
            for offset, token in enumerate(tokens):
                pos = start + offset
                block = blocks[pos // BLOCK_SIZE]
                if block.ref_cnt > 1 or block.block_hash is not None:
                    # Only the tokens a block is registered with may be written into a shared or cached
                    # block: a request completing a block that a prefix hit already shares this step.
                    assert offset < num_real, f"{req_id}: a proposal lands in shared/cached block {block.block_id}"
                    assert block.block_hash is not None and block.token_ids[pos % BLOCK_SIZE] == token, \
                        f"{req_id} writes position {pos} into shared block {block.block_id}"
                self.device.setdefault(block.block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = token
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk
            num_accepted = self.rng.randint(0, len(proposals))
            self.num_accepted += num_accepted
            self.num_rejected += len(proposals) - num_accepted
            sampled[req_id] = proposals[:num_accepted] + [self.rng.randrange(3, 3 + self.alphabet)]
            for child in self.sched.forks.samples_of(request):
                sampled[child.req_id] = [self.rng.randrange(3, 3 + self.alphabet)]
        return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=drafted)

    def check(self) -> None:
        kv = self.sched.kv
        for request in self.sched.running:
            blocks = kv.req_to_blocks.get(request.req_id, [])
            for pos in range(request.num_computed_tokens):
                slot = self.device[blocks[pos // BLOCK_SIZE].block_id][pos % BLOCK_SIZE]
                assert slot == request.all_token_ids[pos], f"{request.req_id}: position {pos} holds {slot}"
        for block in kv.pool.blocks:
            if block.block_hash is not None:
                assert tuple(self.device[block.block_id]) == block.token_ids, f"cached block {block.block_id} is stale"


def _add(sched: Scheduler, rng: random.Random, index: int, prompt_len: int, max_tokens: int, n: int,
         alphabet: int) -> None:
    prompt = [rng.randrange(3, 3 + alphabet) for _ in range(prompt_len)]
    core_req = EngineCoreRequest(f"q{index}", prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                                 frozenset({2}), max_tokens)
    requests = Request.for_sequences(core_req)
    try:
        sched.add_request(requests[0], parallel_samples=requests[1:])
    except Exception as e:  # only the documented refusals are allowed
        assert "whole cache" in str(e) or "max_num_seqs" in str(e)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 16), st.integers(1, 3)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 1000), st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=50,
)


@settings(max_examples=120, deadline=None)
@given(ops=operations, num_blocks=st.integers(10, 30), budget=st.integers(1, 40), caching=st.booleans(),
       swap=st.booleans(), k=st.integers(1, 5), seed=st.integers(0, 2**16), alphabet=st.integers(2, 6),
       draft=st.booleans())
def test_proposals_and_rollbacks_never_leak_nor_write_shared_blocks(ops, num_blocks, budget, caching, swap, k,
                                                                     seed, alphabet, draft):
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=200)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, caching, num_host_blocks=12 if swap else 0)
    spec_config = (SpeculativeConfig(method="draft_model", model=DRAFT_DIR, num_speculative_tokens=k) if draft
                   else SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3))
    sched = Scheduler(config, kv, "swap" if swap else "recompute", speculative_config=spec_config)
    rng = random.Random(seed)
    runner = FakeKVRunner(sched, rng, alphabet)

    def step() -> None:
        out = sched.schedule()
        assert not (out.scheduled_spec_tokens and out.num_draft_tokens)  # one method per engine
        counts = {req_id: len(p) for req_id, p in out.scheduled_spec_tokens.items()} | out.num_draft_tokens
        for req_id, num_proposals in counts.items():
            request = sched.requests[req_id]
            assert request.beam_group_id is None and 1 <= num_proposals <= k
            assert out.num_scheduled_tokens[req_id] == 1 + num_proposals
            assert request.num_output_tokens + num_proposals + 1 <= request.max_tokens
        sched.update_from_output(out, runner.execute(out))
        _check_block_invariants(sched)
        runner.check()

    for index, (op, x, y, n) in enumerate(ops):
        if op == "add":
            _add(sched, rng, index, x, y, n, alphabet)
        elif op == "step":
            step()
        elif sched.requests:
            live = sorted(sched.requests)
            sched.finish_requests([live[x % len(live)]], RequestStatus.FINISHED_ABORTED)
            _check_block_invariants(sched)
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests()
    assert sched.kv.check_no_leaks() == []


def test_speculation_happens_and_is_rolled_back_in_a_plain_run():
    """Deterministic: a repetitive prompt gets proposals; a partial acceptance frees the block that
    only rejected proposals reached."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=200)
    kv = KVCacheManager(40, BLOCK_SIZE, True)
    sched = Scheduler(config, kv, speculative_config=SpeculativeConfig(num_speculative_tokens=5))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    request = Request("a", prompt, SamplingParams(max_tokens=20), frozenset({2}), 20)
    sched.add_request(request)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 9} and not out.scheduled_spec_tokens
    sched.update_from_output(out, ModelRunnerOutput({"a": [9]}))
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"a": [5, 6, 7, 8, 9]}  # "7 8 9" came before, followed by these
    assert out.num_scheduled_tokens == {"a": 6}
    assert len(kv.req_to_blocks["a"]) == 4  # positions 0..14: ceil(15 / 4)
    sched.update_from_output(out, ModelRunnerOutput({"a": [5, 4]}))  # one kept, then the model's own 4
    assert request.output_token_ids == [9, 5, 4]
    assert request.num_computed_tokens == 11 and request.num_tokens == 12
    assert len(kv.req_to_blocks["a"]) == 3  # the fourth block held only rejected positions: freed
    assert sched.spec.stats.num_draft_tokens == 5 and sched.spec.stats.num_accepted_tokens == 1
    assert sched.spec.stats.accepted_per_position == [1, 0, 0, 0, 0]


def test_no_proposal_past_max_tokens_or_for_a_prompt_chunk():
    proposer = NgramProposer(1, 3)
    assert proposer.propose("x", [1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert proposer.propose("x", [1, 2, 3, 1, 2, 3], 2) == [1, 2]  # incremental index, latest occurrence
    assert proposer.propose("y", [1, 2, 3], 4) == []
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=200)
    sched = Scheduler(config, KVCacheManager(40, BLOCK_SIZE, False),
                      speculative_config=SpeculativeConfig(num_speculative_tokens=5))
    request = Request("a", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=3), frozenset({2}), 3)
    sched.add_request(request)
    out = sched.schedule()  # a chunk of 4: no proposals
    assert not out.scheduled_spec_tokens
    sched.update_from_output(out, ModelRunnerOutput({}))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"a": [5]}))
    out = sched.schedule()  # 1 output of 3: at most 1 proposal (it + the bonus make 3)
    assert out.scheduled_spec_tokens == {"a": [6]}


def test_low_acceptance_backs_off_longer_each_time_and_success_resets_it():
    from pagedllm.core.spec_planner import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]

    def pause_then_proposal() -> tuple[int, list[int]]:
        for paused in range(200):
            proposal = spec.propose("a", tokens, 4)
            if proposal:
                return paused, proposal
        raise AssertionError("never proposes again")

    assert spec.propose("a", tokens, 4) == [2, 3, 4, 5]
    pauses = []
    for _ in range(4):
        spec.record("a", 4, 0, 1)
        paused, proposal = pause_then_proposal()
        pauses.append(paused)
        assert len(proposal) < 4  # fewer proposals after failures too
    assert pauses[0] > 0 and pauses == sorted(pauses) and pauses[-1] > pauses[0]
    spec.record("a", len(proposal), len(proposal), len(proposal) + 1)  # all kept
    assert spec.propose("a", tokens, 4) == [2, 3, 4]
    spec.record("a", 3, 3, 4)
    assert spec.propose("a", tokens, 4) == [2, 3, 4, 5]
    assert spec.stats.num_bonus_tokens == 6


def test_at_large_batches_only_requests_that_keep_most_proposals_speculate():
    from pagedllm.core.spec_planner import PROBE_INTERVAL, SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]
    for req_id, kept in (("copying", 4), ("chatting", 1)):
        assert spec.propose(req_id, tokens, 4, batch_size=16) == [2, 3, 4, 5]
        spec.record(req_id, 4, kept, kept + 1)
    # 25% kept: worth it at batch 1 (bar 20%), not at batch 16 (bar 80%)
    assert spec.propose("chatting", tokens, 4, batch_size=1) == [2, 3, 4, 5]
    spec.record("chatting", 4, 1, 2)  # acceptance 0.25, mean kept 1.75
    assert spec.propose("chatting", tokens, 4, batch_size=16) == []
    assert [spec.propose("chatting", tokens, 4, batch_size=16) for _ in range(PROBE_INTERVAL - 1)] == \
        [[]] * (PROBE_INTERVAL - 1)
    assert spec.propose("chatting", tokens, 4, batch_size=16) == [2, 3, 4]  # a probe after the pause
    spec.record("chatting", 3, 0, 1)
    assert spec.propose("chatting", tokens, 4, batch_size=16) == []  # still below the bar: paused again
    assert spec.propose("copying", tokens, 4, batch_size=16) == [2, 3, 4, 5]


def test_no_proposal_for_a_structured_output_request():
    """Verification does not apply the grammar's mask, so a constrained request never speculates."""
    from pagedllm.sampling_params import StructuredOutputsParams

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=200)
    sched = Scheduler(config, KVCacheManager(40, BLOCK_SIZE, False),
                      speculative_config=SpeculativeConfig(num_speculative_tokens=5))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    params = {"a": SamplingParams(max_tokens=20),
              "b": SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))}
    for req_id, sp in params.items():
        sched.add_request(Request(req_id, list(prompt), sp, frozenset({2}), 20))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"a": [9], "b": [9]}))
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"a": [5, 6, 7, 8, 9]}
    assert out.num_scheduled_tokens == {"a": 6, "b": 1}


def test_draft_model_slots_are_counted_and_rolled_back_against_the_runners_proposals():
    """draft_model: the scheduler sends only a count; acceptance and rollback follow what the runner
    reports it proposed."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=200)
    kv = KVCacheManager(40, BLOCK_SIZE, True)
    sched = Scheduler(config, kv, speculative_config=SpeculativeConfig(method="draft_model", model=DRAFT_DIR,
                                                                       num_speculative_tokens=4))
    request = Request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=20), frozenset({2}), 20)
    sched.add_request(request)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 9} and not out.num_draft_tokens  # a prompt: nothing proposed
    sched.update_from_output(out, ModelRunnerOutput({"a": [40]}))
    out = sched.schedule()
    assert out.num_draft_tokens == {"a": 4} and not out.scheduled_spec_tokens
    assert out.num_scheduled_tokens == {"a": 5}
    assert len(kv.req_to_blocks["a"]) == 4  # positions 0..13: ceil(14 / 4)
    sched.update_from_output(out, ModelRunnerOutput({"a": [41, 42, 7]}, spec_token_ids={"a": [41, 42, 43, 44]}))
    assert request.output_token_ids == [40, 41, 42, 7]
    assert request.num_computed_tokens == 12 and request.num_tokens == 13
    assert len(kv.req_to_blocks["a"]) == 3  # the fourth block held only rejected positions: freed
    stats = sched.spec.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_bonus_tokens) == (4, 2, 1)
    assert stats.accepted_per_position == [1, 1, 0, 0] and stats.proposed_per_position == [1, 1, 1, 1]
    out = sched.schedule()  # kept 2 of 4: the backoff proposes about one more than it kept
    assert out.num_draft_tokens == {"a": 4}
    sched.update_from_output(out, ModelRunnerOutput({"a": [9]}, spec_token_ids={"a": [1, 1, 1, 1]}))
    assert request.num_computed_tokens == 13 and len(kv.req_to_blocks["a"]) == 4


def test_a_draft_model_that_is_seldom_right_stops_the_whole_batch_for_longer_each_time():
    """The draft's cost is per pass, not per request: below the bar engine-wide, no request proposes
    for 8, then 16, ... 64 steps; a step that clears the bar reopens it at once."""
    from pagedllm.core.spec_planner import MAX_GATE_INTERVAL, PROBE_INTERVAL, SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(method="draft_model", model=DRAFT_DIR, num_speculative_tokens=4))
    ids = [f"r{i}" for i in range(16)]
    drafting_steps, probe_sizes = [], set()
    for step in range(600):
        spec.begin_step(batch_size=16)
        assert spec.keeps_draft_up == (step == 0)  # over prompts too only until the gate first finds it bad
        proposing = {r: k for r in ids if (k := spec.num_to_propose(r, 4, batch_size=16))}
        if proposing:
            drafting_steps.append(step)
            if step > 0:
                probe_sizes |= set(proposing.values())
        for r, k in proposing.items():
            spec.record(r, k, 0, 1)  # every proposal fails
    assert probe_sizes == {1}  # after the first closing, each reopening is a probe of one proposal each
    gaps = [b - a for a, b in zip(drafting_steps, drafting_steps[1:])]
    assert gaps[0] >= PROBE_INTERVAL and all(b >= a for a, b in zip(gaps, gaps[1:5])), gaps
    assert all(g >= MAX_GATE_INTERVAL for g in gaps[3:]), gaps
    assert len(drafting_steps) <= 600 // MAX_GATE_INTERVAL + 4  # the draft ran on under 3% of steps
    # once open, proposals that are kept reset the pause to its shortest
    while spec._gate.closed_steps:
        spec.begin_step(batch_size=16)
    for r in ids:
        spec.record(r, 2, 2, 3)
    spec.begin_step(batch_size=16)
    assert spec._step_open and spec._gate.interval == PROBE_INTERVAL
    assert spec.keeps_draft_up and spec.num_to_propose("fresh", 4, batch_size=16) == 4
