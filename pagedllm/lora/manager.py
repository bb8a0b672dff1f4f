"""The worker's adapters: read ones in a CPU LRU (max_cpu_loras), resident ones in the model's fixed slots
(max_loras), and each step's rows' slots (LoRAStep).

The scheduler admits no more distinct adapters into the running set than there are slots
(core/lora_admission.py), so ``activate`` always finds a slot: free, or held by an adapter this step does
not use (the least recently used such one is evicted).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from pagedllm.lora.layers import LoRASlots, LoRAStep, SlotArena, slot_shapes
from pagedllm.lora.peft import LoRAWeights, load_adapter
from pagedllm.lora.request import LoRAError, LoRARequest
from pagedllm.model.layers import fused_decoder

logger = logging.getLogger(__name__)

# HF projection -> (our linear under a decoder layer, part index of the fused output)
_TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_NUM_PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


def _linear_parts(linear) -> list[int]:
    if hasattr(linear, "q_size"):
        return [linear.q_size, linear.kv_size, linear.kv_size]
    if hasattr(linear, "output_sizes"):
        return [s // linear.tp_size for s in linear.output_sizes]
    return [linear.output_size]  # a row-parallel linear keeps every output (a quantized one's weight is empty)


class LoRAManager:
    """Loads adapters and keeps them in the model's slots; the model runner asks, once per step."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        layers = model.model.layers
        self.num_layers = len(layers)
        embedding = model.model.embed_tokens.weight  # the activations' dtype and device
        dtype, device = embedding.dtype, embedding.device
        self.device = device
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        self.linears: dict[tuple[int, str], torch.nn.Module] = {}
        shapes = {}  # (layer, linear) -> LoRASlots' arguments, in the order a step reads them
        for index, layer in enumerate(layers):
            for name in _NUM_PARTS:
                linear = layer.get_submodule(name) if _has(layer, name) else None
                if linear is None:
                    continue
                self.linears[(index, name)] = linear
                shapes[(index, name)] = (
                    linear.input_size_per_partition if hasattr(linear, "input_size_per_partition") else linear.input_size,
                    _linear_parts(linear), max_loras, max_lora_rank)
        arena = SlotArena(SlotArena.nbytes([s for args in shapes.values() for s in slot_shapes(*args)], dtype), device)
        for key, args in shapes.items():
            self.linears[key].lora = self.slots[key] = LoRASlots(*args, dtype, device, arena=arena)
        fused_decoder.invalidate(model.model)  # a plan made before the slots existed would skip their deltas
        self.cpu_cache: OrderedDict[int, LoRAWeights] = OrderedDict()
        """Read adapters by id, least recently used first."""
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        """Resident adapters: id -> slot, least recently used first."""
        self.free_slots = list(range(max_loras))

    def activate(self, lora_requests: Iterable[LoRARequest]) -> dict[int, LoRAError]:
        """Make every adapter of this step resident; returns the ids that could not be (with the reason)."""
        wanted = {r.lora_int_id: r for r in lora_requests}
        assert len(wanted) <= self.max_loras, f"the scheduler let {len(wanted)} adapters into one step"
        failed = {}
        for lora_id, request in wanted.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            try:
                weights = self._read(request)
            except LoRAError as error:
                failed[lora_id] = error
                continue
            slot = self.free_slots.pop(0) if self.free_slots else self._evict_slot(keep=wanted)
            self._fill(slot, weights)
            self.slot_of[lora_id] = slot
        return failed

    def prepare_step(self, lora_requests: Sequence[LoRARequest | None]) -> tuple[list[int], dict[int, str]]:
        """For a step's requests (their adapters, in batch order): make the adapters resident, and return the
        batch order that puts each adapter's requests side by side (base first, then by slot) without the
        requests whose adapter failed to load, and those requests' errors by index."""
        errors = self.activate(r for r in lora_requests if r is not None)
        failed = {i: str(errors[r.lora_int_id]) for i, r in enumerate(lora_requests)
                  if r is not None and r.lora_int_id in errors}
        kept = [i for i in range(len(lora_requests)) if i not in failed]
        kept.sort(key=lambda i: -1 if lora_requests[i] is None else self.slot_of[lora_requests[i].lora_int_id])
        return kept, failed

    def step_rows(self, lora_requests: Sequence[LoRARequest | None], num_rows: Sequence[int]) -> LoRAStep | None:
        """The adapted rows of a batch whose request i runs num_rows[i] rows (its adapters resident); None when
        every row is the base model's."""
        return self.rows_of([None if r is None else self.slot_of[r.lora_int_id] for r in lora_requests], num_rows)

    def rows_of(self, slots: Sequence[int | None], num_rows: Sequence[int]) -> LoRAStep | None:
        """(slot or None per request, rows per request), in batch order -> the step's LoRAStep (None: no adapter):
        one (begin, end, slot) segment per run of consecutive requests on one slot; base requests get none."""
        segments: list[int] = []
        row = 0
        for slot, n in zip(slots, num_rows):
            if slot is not None and n > 0:
                if segments and segments[-1] == slot and segments[-2] == row:
                    segments[-2] = row + n  # the previous request's slot: one longer segment
                else:
                    segments += [row, row + n, slot]
            row += n
        return LoRAStep(segments) if segments else None

    def _read(self, request: LoRARequest) -> LoRAWeights:
        weights = self.cpu_cache.get(request.lora_int_id)
        if weights is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return weights
        weights = load_adapter(request.lora_path, self.max_lora_rank, self.num_layers)
        for layer, proj in weights.weights:
            if (layer, _TARGETS[proj][0]) not in self.slots:
                raise LoRAError(f"{request.lora_path!r}: target module {proj!r} of layer {layer} is not a "
                                f"linear this model has")
        self._check_shapes(request.lora_path, weights)
        self.cpu_cache[request.lora_int_id] = weights
        while len(self.cpu_cache) > self.max_cpu_loras:
            evicted, _ = self.cpu_cache.popitem(last=False)
            logger.info("LoRA adapter %d dropped from the CPU cache (max_cpu_loras=%d)", evicted, self.max_cpu_loras)
        return weights

    def _check_shapes(self, path: str, weights: LoRAWeights) -> None:
        """LoRAError unless each (A, B) fits the linear it patches: A [rank, in], B [out of its part, rank] (this
        rank's share after sharding), so a foreign adapter is refused here, not by a copy inside a step."""
        for (layer, proj), (a, b) in weights.weights.items():
            name, part = _TARGETS[proj]
            linear = self.linears[(layer, name)]
            slots = self.slots[(layer, name)]
            full_in = getattr(linear, "input_size", None)
            if a.dim() != 2 or b.dim() != 2 or (linear.tp_size == 1 and full_in is not None and a.shape[1] != full_in):
                raise LoRAError(f"{path!r}: layer {layer} {proj}'s lora_A has shape {list(a.shape)}, lora_B "
                                f"{list(b.shape)}; the model's {proj} takes {full_in} inputs")
            try:
                a_shard, b_shard = _shard(linear, part, a, b)
            except RuntimeError:
                a_shard = b_shard = None
            expected_out = _linear_parts(linear)[part]
            if (b_shard is None or b_shard.shape[0] != expected_out or a_shard.shape[1] != slots.in_features
                    or linear.tp_size == 1 and b.shape[0] != expected_out):
                raise LoRAError(f"{path!r}: layer {layer} {proj}'s lora_B has shape {list(b.shape)}, lora_A "
                                f"{list(a.shape)}; the model's {proj} has {expected_out} outputs (per shard) and "
                                f"{slots.in_features} inputs")

    def _evict_slot(self, keep: dict) -> int:
        for lora_id, slot in self.slot_of.items():  # least recently used first
            if lora_id not in keep:
                del self.slot_of[lora_id]
                return slot
        raise AssertionError("no slot to evict: more adapters in one step than max_loras")

    def _fill(self, slot: int, weights: LoRAWeights) -> None:
        for (layer, name), slots in self.slots.items():
            parts: list = [None] * _NUM_PARTS[name]
            for proj, (target, part) in _TARGETS.items():
                if target == name and (layer, proj) in weights.weights:
                    parts[part] = weights.weights[(layer, proj)]
            if any(p is not None for p in parts):
                linear = self.linears[(layer, name)]
                slots.set_slot(slot, weights.rank, [None if p is None else _shard(linear, i, *p)
                                                    for i, p in enumerate(parts)])
            else:
                slots.clear_slot(slot)


def _shard(linear, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of one part's (A [rank, in], B [out, rank]), sharded as the linear it patches: a
    column-parallel linear keeps its rows of B; a row-parallel one its columns of A, so each rank adds
    B (A_shard x_shard) before the linear's all-reduce, which sums them to B A x."""
    if linear.tp_size == 1:
        return a, b
    if hasattr(linear, "q_size"):  # q heads split; KV heads split or replicated (kv_head_start says where)
        start, size = ((linear.tp_rank * linear.q_size, linear.q_size) if part == 0
                       else (linear.kv_head_start * linear.head_dim, linear.kv_size))
        return a, b.narrow(0, start, size)
    if hasattr(linear, "output_sizes"):
        size = linear.output_sizes[part] // linear.tp_size
        return a, b.narrow(0, linear.tp_rank * size, size)
    size = linear.input_size_per_partition
    return a.narrow(1, linear.tp_rank * size, size).contiguous(), b


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False
