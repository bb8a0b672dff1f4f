"""One step's LoRA deltas over the default model's 120 linears (30 layers x qkv, o, gate_up, down), against
those linears' own products, per row count:

    PYTHONPATH=$PWD .venv/bin/python scripts/lora_delta_bench.py [--rows 1 16 64] [--adapters 4] [--rank 16]

``base``: the model's linears (``LinearBase.matmul``, its loaded weights). ``masked``: the delta as
pagedllm/lora/layers.py ran it until session 11: shrink over every slot's columns with the compiled GEMM,
a mask keeping each row's own slot block, expand over every slot's rows (L*W columns for every row).
``sgmv``: ``lora_sgmv_cpu``, each segment by its own slot's columns. max_loras = 8 slots per linear, each
a distinct tensor per layer (nothing stays in cache across linears, as in a step); ``--adapters`` of them
spread over the rows, grouped by slot as the runner groups them. The three paths alternate linear by
linear; per repetition each path's calls are summed; the table gives the median over repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.lora.layers import LoRASlots
from pagedllm.model import load_model
from pagedllm.model.layers import cpu_gemm

SERIAL_ELEMENTS = 32768


def _serial(op, out: torch.Tensor, other: torch.Tensor) -> None:
    """The masked path's elementwise ops, in pieces small enough to stay off ATen's OpenMP region."""
    if out.numel() <= SERIAL_ELEMENTS:
        op(out, other)
        return
    out, other = out.view(-1), other.reshape(-1)
    for i in range(0, out.numel(), SERIAL_ELEMENTS):
        op(out[i:i + SERIAL_ELEMENTS], other[i:i + SERIAL_ELEMENTS])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    nr = cpu_gemm.panel_width()
    n, k = weight.shape
    num_panels = -(-n // nr)
    padded = torch.zeros(num_panels * nr, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(num_panels, nr, k).transpose(1, 2).contiguous()


class Masked:
    """The pre-session-11 delta of one linear's slots (a copy of its arithmetic, for comparison)."""

    def __init__(self, slots: LoRASlots, row_slots: torch.Tensor) -> None:
        num_slots = slots.ranks.shape[0]
        a = torch.cat([slots.slot_a(s) for s in range(num_slots)], dim=1)  # [in, L*W], the old layout
        b = torch.cat([slots.slot_b(s) for s in range(num_slots)], dim=0)  # [L*W, out]
        self.a_packed, self.b_packed = _pack(a.t()), _pack(b.t())
        self.n_a, self.n_b = a.shape[1], b.shape[1]
        columns = torch.arange(self.n_a) // slots.width
        self.mask = (row_slots[:, None] == columns[None, :]).float()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        shrunk = cpu_gemm.gemm(x, self.a_packed, None, self.n_a)
        _serial(torch.Tensor.mul_, shrunk, self.mask)
        _serial(torch.Tensor.add_, y, cpu_gemm.gemm(shrunk, self.b_packed, None, self.n_b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None).model
    linears = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear, parts in ((attn.qkv_proj, [attn.qkv_proj.q_size, attn.qkv_proj.kv_size, attn.qkv_proj.kv_size]),
                              (attn.o_proj, [attn.o_proj.output_size]),
                              (mlp.gate_up_proj, list(mlp.gate_up_proj.output_sizes)),
                              (mlp.down_proj, [mlp.down_proj.output_size])):
            k = linear.input_size
            slots = LoRASlots(k, parts, args.max_loras, args.rank, torch.float32, torch.device("cpu"))
            g = torch.Generator().manual_seed(len(linears))
            for slot in range(args.adapters):
                slots.set_slot(slot, args.rank, [(torch.randn(args.rank, k, generator=g) * 0.01,
                                                  torch.randn(size, args.rank, generator=g) * 0.01) for size in parts])
            linears.append((linear, slots))
    print(f"{len(linears)} linears, {args.adapters} adapters of rank {args.rank} in {args.max_loras} slots, "
          f"{args.threads} threads; ms per step (all linears), median of {args.reps}")
    print(" rows    base   masked  (x base)    sgmv  (x base)  sgmv/masked")
    for rows in args.rows:
        row_slots = torch.tensor(sorted(i % args.adapters for i in range(rows)))
        segments = []
        for slot in range(args.adapters):
            where = (row_slots == slot).nonzero().flatten().tolist()
            if where:
                segments += [where[0], where[-1] + 1, slot]
        work = []
        for linear, slots in linears:
            x = torch.randn(rows, slots.in_features)
            bias = linear._parameters.get("bias")
            work.append((linear, slots, Masked(slots, row_slots), x, linear.matmul(x, bias), bias))
        times = {"base": [], "masked": [], "sgmv": []}
        for rep in range(args.reps + 1):
            totals = dict.fromkeys(times, 0.0)
            for linear, slots, masked, x, y, bias in work:
                calls = [("base", lambda: linear.matmul(x, bias)), ("masked", lambda: masked(x, y)),
                         ("sgmv", lambda: slots._op(x, y, slots.a, slots.b, slots.ranks, slots.part_sizes,
                                                    segments, 0))]
                if rep % 2:
                    calls.reverse()
                for name, call in calls:
                    start = time.perf_counter()
                    call()
                    totals[name] += time.perf_counter() - start
            if rep:  # the first is a warm-up
                for name in times:
                    times[name].append(totals[name] * 1e3)
        base, masked, sgmv = (statistics.median(times[n]) for n in ("base", "masked", "sgmv"))
        print(f"{rows:5d} {base:7.2f} {masked:8.2f} {masked / base:8.2f}x {sgmv:8.2f} {sgmv / base:8.2f}x "
              f"{sgmv / masked:10.2f}")


if __name__ == "__main__":
    main()
