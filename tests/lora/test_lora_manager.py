"""The worker's adapter bookkeeping, exactly: which slot each adapter lands in, which one is evicted, what the
CPU cache keeps, how a step's rows are grouped, and where each PEFT tensor lands in the fused slots."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.peft import load_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.model import load_model
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter
from tests.model.tiny_models import make_hf_model, save_hf_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_hf_model("llama", seed=3)
    loaded = load_model(save_hf_model(base, tmp_path_factory.mktemp("base")))
    targets = {1: ALL_PROJECTIONS, 2: ["q_proj", "v_proj"], 3: ["down_proj"], 4: ALL_PROJECTIONS}
    loras = {i: LoRARequest(f"a{i}", i, make_adapter(base, tmp_path_factory.mktemp(f"a{i}"), rank=4 if i == 2 else 8,
                                                      alpha=8, target_modules=t, seed=i))
             for i, t in targets.items()}
    return loaded.model, loras


def test_slots_are_reused_least_recently_used_first_and_the_cpu_cache_is_bounded(setup):
    model, loras = setup
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    assert manager.activate([loras[1]]) == {}
    assert manager.activate([loras[2]]) == {}
    assert dict(manager.slot_of) == {1: 0, 2: 1}
    manager.activate([loras[1]])  # 1 is now the most recently used
    manager.activate([loras[3]])  # evicts 2 (least recently used), takes its slot
    assert dict(manager.slot_of) == {1: 0, 3: 1}
    manager.activate([loras[2], loras[3]])  # 1 is not in this step: its slot goes to 2
    assert dict(manager.slot_of) == {3: 1, 2: 0}
    assert list(manager.cpu_cache) == [1, 3, 2]  # 2 was read again from the CPU cache last; 3 stayed resident
    manager.activate([loras[4]])  # a fourth adapter read: the CPU cache drops 1, its least recently used
    assert list(manager.cpu_cache) == [3, 2, 4]
    with pytest.raises(AssertionError, match="3 adapters into one step"):
        manager.activate([loras[1], loras[2], loras[3]])


def test_an_adapter_that_does_not_fit_is_refused_and_the_others_still_load(setup, tmp_path):
    """A foreign adapter (trained on a wider model) or a truncated file is a LoRAError naming the reason, not a
    copy failing inside a step."""
    model, loras = setup
    wider = make_adapter(make_hf_model("llama", seed=4, intermediate_size=256), tmp_path / "wider", rank=4, alpha=8,
                         target_modules=["down_proj"], seed=3)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for file in (tmp_path / "wider").iterdir():
        data = file.read_bytes()
        (truncated / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    failed = manager.activate([LoRARequest("wider", 11, wider), loras[1]])
    assert list(failed) == [11]
    assert "layer 0 down_proj's lora_A has shape [4, 256], lora_B [64, 4]; the model's down_proj takes 128 inputs" \
        in str(failed[11])
    failed = manager.activate([LoRARequest("truncated", 12, str(truncated))])
    assert "adapter_model.safetensors': tensor" in str(failed[12]) and "file truncated" in str(failed[12])
    assert dict(manager.slot_of) == {1: 0}


def test_step_rows_are_segments_of_consecutive_requests_on_one_slot(setup):
    model, _ = setup
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    step = manager.rows_of([None, 0, 0, 1, None, 0], [3, 2, 1, 2, 1, 2])
    assert step.segments == [3, 6, 0, 6, 8, 1, 9, 11, 0]  # requests 1-2 share slot 0: one segment
    assert manager.rows_of([None, None], [4, 1]) is None


def test_peft_tensors_land_in_their_fused_parts(setup):
    model, loras = setup
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    manager.activate([loras[2]])  # rank 4, q and v only: slot 0
    weights = load_adapter(loras[2].lora_path, 8, manager.num_layers).weights
    slots = manager.slots[(1, "self_attn.qkv_proj")]
    a_q, b_q = weights[(1, "q_proj")]
    a_v, b_v = weights[(1, "v_proj")]
    q, kv = slots.part_sizes[0], slots.part_sizes[1]
    a, b = slots.slot_a(0), slots.slot_b(0)  # [in, 3*8], [3*8, out]: rank 4 uses columns 0-11
    torch.testing.assert_close(a[:, 0:4], a_q.t(), rtol=0, atol=0)
    torch.testing.assert_close(a[:, 8:12], a_v.t(), rtol=0, atol=0)
    assert not a[:, 4:8].any() and not b[4:8].any()  # k is not targeted
    assert not a[:, 12:].any() and not b[12:].any()  # beyond the rank
    torch.testing.assert_close(b[0:4, :q], b_q.t(), rtol=0, atol=0)
    torch.testing.assert_close(b[8:12, q + kv:], b_v.t(), rtol=0, atol=0)
    assert not b[0:4, q:].any() and not b[8:12, :q + kv].any()  # block-diagonal
    assert not slots.slot_a(1).any()  # the other slot is empty
    assert not manager.slots[(1, "mlp.gate_up_proj")].slot_b(0).any()  # untargeted linears stay off


def test_all_slots_are_cut_from_one_arena_in_the_order_a_step_reads_them(setup):
    """One buffer (on huge pages where the platform gives them) holds every linear's a and b, layer by layer,
    qkv, o, gate_up, down, a before b: 64-byte aligned, not overlapping, zeroed until an adapter is loaded."""
    model, loras = setup
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    keys = list(manager.slots)
    assert keys == [(layer, name) for layer in range(manager.num_layers)
                    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    tensors = [t for key in keys for t in (manager.slots[key].a, manager.slots[key].b)]
    storage = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)
    end = 0
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 64 == 0 and not t.any()
        assert t.data_ptr() >= end  # in order, after the previous one
        end = t.data_ptr() + t.numel() * t.element_size()
    manager.activate([loras[1]])
    assert manager.slots[keys[0]].a[0].any() and not manager.slots[keys[0]].a[1].any()
