"""EngineCore: the loop body of serving. Schedule, execute, update; nothing else.

It owns the scheduler (with its KV cache manager) and an executor: the model runner in this
process (tensor_parallel_size=1), or N tensor-parallel worker processes. Front ends talk to it
through EngineCoreRequest in and EngineCoreOutput out; text is made elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch

from pagedllm.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedllm.core.forking import kv_block_usage
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreRequest, EngineStatsMsg
from pagedllm.distributed.shapes import check_config_tp_size, tp_shape
from pagedllm.model.loader import LoadedModel, load_model, load_model_info
from pagedllm.worker.executor import Executor, UniprocExecutor
from pagedllm.worker.gpu import profile_num_kv_blocks, resolve_device
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineCore:
    """Scheduler + model runner, stepped by the caller (in-process) or a busy loop (its own process)."""

    def __init__(self, engine_args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        device = resolve_device(engine_args.device)
        if engine_args.dtype == "auto":
            engine_args = dataclasses.replace(engine_args, dtype="bfloat16" if device.type == "cuda" else "float32")
        dtype = _DTYPES[engine_args.dtype]
        tp_size = engine_args.tensor_parallel_size
        if tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
        if tp_size > 1 and device.type != "cpu":
            raise ValueError("tensor parallelism runs on the CPU (gloo) so far; pass device='cpu' (--device cpu)")
        if loaded is None:
            # With tensor parallelism the weights live in the workers: read only config and tokenizer.
            loaded = load_model(engine_args.model, dtype=dtype, device=str(device)) if tp_size == 1 else load_model_info(engine_args.model)
        self.loaded = loaded
        hf_config = self.loaded.hf_config
        model = self.loaded.model
        self.cache_config: CacheConfig = engine_args.cache_config()
        self.scheduler_config: SchedulerConfig = engine_args.scheduler_config(
            getattr(hf_config, "max_position_embeddings", 4096)
        )
        if tp_size == 1:
            num_kv_heads, head_dim = model.num_kv_heads, model.head_dim
        else:  # each rank caches only its own KV heads
            check_config_tp_size(hf_config, tp_size)
            num_heads = hf_config.num_attention_heads
            num_kv_heads = tp_shape(tp_size, 0, num_heads, getattr(hf_config, "num_key_value_heads", None)
                                    or num_heads).num_kv_heads
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        self.kv_spec = KVCacheSpec(
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=self.cache_config.block_size,
            dtype=dtype,
        )
        num_blocks = self.cache_config.num_kv_blocks or self.kv_spec.num_blocks_for_memory(
            self.cache_config.kv_cache_memory
        )
        if device.type == "cuda" and model is not None and self.cache_config.num_kv_blocks is None:
            num_blocks = profile_num_kv_blocks(  # CUDA: what gpu_memory_utilization leaves, not kv_cache_memory
                model, self.kv_spec.bytes_per_block, self.scheduler_config.max_num_batched_tokens,
                self.scheduler_config.max_num_seqs, engine_args.gpu_memory_utilization, device,
            )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={self.cache_config.kv_cache_memory} bytes is less than one KV block "
                f"({self.kv_spec.bytes_per_block} bytes); raise it"
            )
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d KiB per block): at most %d tokens in flight",
            num_blocks, self.cache_config.block_size, num_blocks * self.kv_spec.bytes_per_block / 2**20,
            self.kv_spec.bytes_per_block // 1024, num_blocks * self.cache_config.block_size,
        )
        num_host_blocks = 0
        if self.cache_config.preemption_mode == "swap":
            num_host_blocks = self.kv_spec.num_blocks_for_memory(self.cache_config.swap_space)
            logger.info("Swap space: %d host blocks", num_host_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.cache_config.block_size, self.cache_config.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        if engine_args.kv_allocation_policy != "paged":  # contiguous-reservation baselines (benchmarks)
            from pagedllm.core.contiguous_allocator import ContiguousKVCacheManager

            self.kv_cache_manager = ContiguousKVCacheManager(
                num_blocks, self.cache_config.block_size, engine_args.kv_allocation_policy,
                self.scheduler_config.max_model_len, engine_args.kv_allocator,
            )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.cache_config.preemption_mode)
        self.runner: ModelRunner | None = None  # in this process only when tensor_parallel_size == 1
        self.executor: Executor
        if tp_size == 1:
            self.runner = ModelRunner(
                model, vocab_size=hf_config.vocab_size, kv_spec=self.kv_spec, num_blocks=num_blocks,
                seed=engine_args.seed, num_host_blocks=num_host_blocks,
                device=device, attention_backend=engine_args.attention_backend,
                enforce_eager=engine_args.enforce_eager, max_num_seqs=self.scheduler_config.max_num_seqs,
                max_model_len=self.scheduler_config.max_model_len,
            )
            self.executor = UniprocExecutor(self.runner)
        else:
            from pagedllm.worker.executor import MultiprocTPExecutor

            logger.info("tensor parallel: %d ranks, %d KV heads each", tp_size, num_kv_heads)
            self.executor = MultiprocTPExecutor(
                model_dir=self.loaded.model_path, dtype=engine_args.dtype, tp_size=tp_size,
                kv_spec=self.kv_spec, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                seed=engine_args.seed, master_addr=engine_args.master_addr, master_port=engine_args.master_port,
                num_local_workers=engine_args.num_local_workers, timeout_s=engine_args.distributed_timeout,
            )

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request (and its parallel samples); raises InvalidRequestError if it could never be served."""
        requests = Request.for_sequences(req)
        self.scheduler.add_request(requests[0], parallel_samples=requests[1:])

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests now and free their blocks; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(req_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        """Run one iteration; returns what each touched request produced."""
        self.executor.check_health()  # a dead tensor-parallel group raises EngineDeadError, every time
        if not self.scheduler.has_unfinished_requests():
            return []
        sched_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(sched_output)
        return self.scheduler.update_from_output(sched_output, runner_output)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStatsMsg:
        """A snapshot for metrics and logs (the same message the core process sends)."""
        kv = self.kv_cache_manager
        return EngineStatsMsg(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_evictions=kv.pool.num_evictions,
        )

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
