"""EngineCore: the loop body of serving. Schedule, execute, update; nothing else.

It owns the scheduler (with its KV cache manager) and an executor: the model runner in this
process (tensor_parallel_size=1), or N tensor-parallel worker processes. The executor loads the
model and sizes the KV cache; the core gets back plain numbers (worker/interface.py), so this
module imports neither torch nor the model. Front ends talk to it through EngineCoreRequest in
and EngineCoreOutput out; text is made elsewhere.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable

from pagedllm.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedllm.core.beam_registry import BeamGroups
from pagedllm.core.forking import kv_block_usage
from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol, paged_kv_cache_manager, plugged_factory
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.kv_disk_setup import attach_disk_tier, finish_disk_tier
from pagedllm.engine.protocol import EngineCoreRequest, EngineStatsMsg, KVMapMsg, KVMapRequest
from pagedllm.errors import EngineDeadError
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 0.05
"""An empty step with blocks being read waits up to this long for the first of them: no busy spin, and new work
arriving meanwhile waits no longer than this."""


class EngineCore:
    """Scheduler + executor, stepped by the caller (in-process) or a busy loop (its own process).

    `executor`: one already built (tests); by default the one `engine_args` call for. The KV cache manager
    over the executor's blocks is the paged one, unless a benchmark plugged in its allocation baseline
    (core/kv_cache_interface.py's `plugged_kv_cache_manager`).
    """

    def __init__(self, engine_args: EngineArgs, *, executor: Executor | None = None) -> None:
        self.cache_config: CacheConfig = engine_args.cache_config()
        if executor is None:
            from pagedllm.worker.executor import create_executor  # torch and the model load behind this line

            executor = create_executor(engine_args, engine_args.parallel_config())
        self.executor = executor
        try:
            self.model_info: ModelInfo = executor.model_info
            self.scheduler_config: SchedulerConfig = engine_args.scheduler_config(
                self.model_info.max_position_embeddings, self.model_info.device_type)
            self.kv_info: KVCacheInfo = executor.initialize_kv_cache(self.cache_config, self.scheduler_config)
            factory = plugged_factory()
            if factory is None:  # the product's: frees blocks behind a window all layers share
                self.kv_cache_manager: KVCacheManagerProtocol = paged_kv_cache_manager(
                    self.kv_info.num_blocks, self.kv_info.num_host_blocks, self.cache_config, self.scheduler_config,
                    sliding_window=self.kv_info.sliding_window)
            else:
                self.kv_cache_manager = factory(
                    self.kv_info.num_blocks, self.kv_info.num_host_blocks, self.cache_config, self.scheduler_config)
        except BaseException:
            executor.shutdown()  # tensor-parallel workers may already be running
            raise
        self.disk_tier = None
        if self.cache_config.kv_disk_cache is not None:
            self.disk_tier = attach_disk_tier(self.kv_cache_manager, self.cache_config, engine_args, self.model_info,
                                              self.kv_info)
            # An offline LLM is rarely shut down: its cached prefixes still reach the disk at exit.
            weakref.finalize(self, finish_disk_tier, self.disk_tier, executor)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.cache_config.preemption_mode,
                                   speculative_config=engine_args.speculative(),
                                   max_loras=lora.max_loras if (lora := engine_args.lora_config()) else None,
                                   disk_tier=self.disk_tier)
        kv, max_step_tokens = self.kv_cache_manager, self.scheduler_config.max_num_batched_tokens
        self.beams = BeamGroups(self.scheduler_config, kv.num_blocks, lambda n: kv.max_blocks_held(n, max_step_tokens))
        """Beam-search requests: stepped after each step from their beams' top logprobs; they decide,
        this core tells the scheduler (`_step_beam_groups`)."""
        self.kv_bytes_per_block = self.kv_info.bytes_per_block * engine_args.parallel_config().tensor_parallel_size
        """One block's K and V over every layer and tensor-parallel rank."""
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        """Tokens computed so far, prompt and output (throughput = its rate)."""
        self.step_listeners: list[Callable[[SchedulerOutput, ModelRunnerOutput], None]] = []
        """Called after each executed step with what ran and what came back (benchmarks record step shapes)."""

    @property
    def loaded(self) -> ModelInfo:
        """The model's config, tokenizer and path (its old name; prefer `model_info`)."""
        return self.model_info

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (a windowed cache keeps one back as its null block)."""
        return self.kv_cache_manager.num_blocks

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request (and its parallel samples); raises InvalidRequestError if it could never be served.

        A beam-search request becomes a beam group (core/beam_selection.py), scheduled beside the others."""
        if req.sampling_params.use_beam_search:
            self.scheduler.add_request(self.beams.add(req))
            return
        requests = Request.for_sequences(req)
        self.scheduler.add_request(requests[0], parallel_samples=requests[1:])

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests now and free their blocks; unknown or finished ids are ignored.
        Any sequence id of a beam-search request ends its whole group."""
        others, beams = self.beams.abort(req_ids)
        self.scheduler.finish_requests(beams, RequestStatus.FINISHED_ABORTED)
        self.scheduler.finish_requests(others, status)

    def step(self) -> list[EngineCoreOutput]:
        """Run one iteration; returns what each touched request produced."""
        if self.executor.failure is not None:  # checked idle too: a dead tensor-parallel group is found at once
            raise EngineDeadError(self.executor.failure)
        if not self.scheduler.has_unfinished_requests():
            return []
        sched_output = self.scheduler.schedule()
        if self.disk_tier is not None:
            sched_output.kv_spill, sched_output.kv_load = self.disk_tier.take_step_io()
        runner_output = self.executor.execute_model(sched_output)
        if self.disk_tier is not None:
            self.disk_tier.complete(runner_output.kv_spilled)
            if not sched_output.total_num_scheduled_tokens and self.scheduler.loading:
                self.disk_tier.wait_for_reads(LOAD_WAIT_S)  # only loads are pending: no busy spin meanwhile
        self.num_steps += 1
        self.num_scheduled_tokens += sched_output.total_num_scheduled_tokens
        for listener in self.step_listeners:
            listener(sched_output, runner_output)
        outputs = self.scheduler.update_from_output(sched_output, runner_output)
        return self._step_beam_groups(outputs) if self.beams.groups else outputs  # no beam calls without beams

    def _step_beam_groups(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Let the beam groups choose their next beams from this step's outputs, then have the scheduler
        fork the children and finish the parents; returns the outputs for the front end."""
        outputs, steps = self.beams.update(outputs)
        for beam_step in steps:
            if not beam_step.children:  # the group finished or failed: its beams end
                self.scheduler.finish_requests(beam_step.parent_ids, RequestStatus.FINISHED_ABORTED)
                continue
            self.scheduler.replace_beams(beam_step.parent_ids, beam_step.children)
            # What sharing saves, measured right after each fork.
            beam_step.group.sharing.record(*kv_block_usage(self.kv_cache_manager, beam_step.group.beam_req_ids))
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and finish the disk tier's writes (idempotent)."""
        if self.disk_tier is not None:
            tier, self.disk_tier = self.disk_tier, None
            finish_disk_tier(tier, self.executor)
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStatsMsg:
        """A snapshot for metrics, logs and benchmarks (the same message the core process sends).

        Counters (preemptions, swap-outs, prefix-cache queries and hits, evictions) only grow."""
        kv = self.kv_cache_manager
        num_beam_blocks, num_beam_blocks_unshared = (kv_block_usage(kv, self.beams.beam_req_ids())
                                                      if self.beams.groups else (0, 0))
        return EngineStatsMsg(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_swap_outs=self.scheduler.num_swap_outs,
            **self._disk_tier_stats(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_evictions=kv.num_evictions,
            num_beam_groups=len(self.beams.groups),
            num_beams_running=self.beams.num_beams_running if self.beams.groups else 0,
            num_beam_kv_blocks=num_beam_blocks,
            num_beam_kv_blocks_saved=num_beam_blocks_unshared - num_beam_blocks,
            num_beam_group_preemptions=self.scheduler.num_beam_group_preemptions,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.num_scheduled_tokens,
            **self._kv_occupancy_stats(),
            **self._spec_decode_stats(),
        )

    def _disk_tier_stats(self) -> dict:
        if self.disk_tier is None:
            return {}
        store, counts = self.disk_tier.store, self.disk_tier.store.stats
        return dict(kv_disk_hit_tokens=self.disk_tier.hit_tokens, kv_disk_miss_blocks=counts.miss_blocks,
                    kv_disk_stored_blocks=counts.stored_blocks, kv_disk_corrupt_blocks=counts.corrupt_blocks,
                    kv_disk_load_seconds=counts.load_seconds, kv_disk_store_seconds=counts.store_seconds,
                    kv_disk_blocks=store.num_blocks, kv_disk_bytes=store.num_bytes, kv_disk_max_bytes=store.max_bytes,
                    kv_disk_num_loading=len(self.scheduler.loading))

    def _kv_occupancy_stats(self) -> dict:
        """KVCacheStats for EngineStatsMsg (counters the manager keeps: no scan)."""
        kv = self.kv_cache_manager.kv_stats()
        return dict(kv_num_blocks=kv.num_blocks, kv_num_used_blocks=kv.num_used_blocks,
                    kv_num_cached_blocks=kv.num_cached_blocks, kv_num_empty_blocks=kv.num_empty_blocks,
                    kv_num_filled_slots=kv.num_filled_slots, kv_num_allocated_slots=kv.num_allocated_slots,
                    kv_num_shared_blocks=kv.num_shared_blocks, kv_num_saved_blocks=kv.num_saved_blocks,
                    kv_saved_bytes=kv.num_saved_blocks * self.kv_bytes_per_block,
                    kv_num_host_blocks=kv.num_host_blocks, kv_num_swapped_blocks=kv.num_swapped_blocks,
                    kv_blocks_by_priority=kv.blocks_by_priority or {})

    def kv_map(self) -> KVMapMsg:
        """The block pool and the queues now (between steps): every block's holders and fill, every live
        request's state and block table. A walk of the pool and the tables: build it when someone looks."""
        start = time.perf_counter()
        kv, sched = self.kv_cache_manager, self.scheduler
        ref_cnts, num_tokens, cached = kv.block_states()
        requests = [self._kv_map_request(r, "running") for r in sched.running]
        requests += [self._kv_map_request(r, "swapped" if kv.is_swapped_out(r) else
                                          "preempted" if r.num_preemptions else "waiting") for r in sched.waiting]
        requests += [self._kv_map_request(r, "loading") for r in sched.loading]
        return KVMapMsg(timestamp=time.time(), block_size=kv.block_size, ref_cnts=ref_cnts, num_tokens=num_tokens,
                        cached_block_ids=cached, requests=requests, num_steps=self.num_steps,
                        num_scheduled_tokens=self.num_scheduled_tokens, num_preemptions=sched.num_preemptions,
                        num_swap_outs=sched.num_swap_outs, prefix_cache_queries=kv.prefix_cache_queries,
                        prefix_cache_hits=kv.prefix_cache_hits, build_time_s=time.perf_counter() - start)

    def _kv_map_request(self, request: Request, state: str) -> KVMapRequest:
        return KVMapRequest(request.req_id, state, request.priority, request.num_prompt_tokens, request.num_tokens,
                            request.num_computed_tokens, self.kv_cache_manager.get_block_ids(request.req_id))

    def _spec_decode_stats(self) -> dict:
        """Speculative-decoding counters for EngineStatsMsg (all zero when it is off)."""
        spec = self.scheduler.spec
        if spec is None:
            return {}
        stats = spec.stats
        return dict(spec_num_steps=stats.num_spec_steps, spec_num_draft_tokens=stats.num_draft_tokens,
                    spec_num_accepted_tokens=stats.num_accepted_tokens, spec_num_bonus_tokens=stats.num_bonus_tokens,
                    spec_accepted_per_position=list(stats.accepted_per_position),
                    spec_proposed_per_position=list(stats.proposed_per_position))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks: a cold cache); False if some are still in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def check_kv_leaks(self) -> list[str]:
        """When idle, every block must be free or cached. Returns the problems found."""
        if self.scheduler.has_unfinished_requests():
            return []
        return self.kv_cache_manager.check_no_leaks()

    def fork_request(self, parent_id: str, child_id: str, last_token_id: int) -> None:
        """Beam search: start `child_id` from a running request that just sampled, with `last_token_id`
        instead of its last token; the child shares every KV block of the parent (copy-on-write)."""
        self.scheduler.fork_request(parent_id, child_id, last_token_id)

    def kv_block_usage(self, req_ids: Iterable[str] | None = None) -> tuple[int, int]:
        """(distinct KV blocks the requests hold, sum of their block-table lengths); None = every live request."""
        return kv_block_usage(self.kv_cache_manager, self.scheduler.requests if req_ids is None else req_ids)
