"""Batch-1 decode with the fused decoder call (model/layers/fused_decoder.py) vs the per-op path, in
one engine, runs interleaved (so machine noise hits both), and where each one's step time goes:

    PYTHONPATH=$PWD .venv/bin/python scripts/fused_decode_bench.py [--threads 2] [--rounds 4]
        [--batch 1] [--prompt-len 128] [--max-tokens 128] [--profile-steps 24]

The engine is the default model as ``LLMEngine`` runs it (Q4_1 GGUF weights, compiled ops, prefix
caching off, so every run prefills its prompt). A run: ``batch`` requests of random prompts, greedy,
``max-tokens`` each (EOS ignored), stepped to the end; its decode steps (every step after the
first) are timed one by one. ``fused_decoder.set_enabled`` switches the path between runs; the
order alternates per round.

Breakdown: per mode, ``profile-rounds`` more runs (interleaved) whose first ``profile-steps`` decode
steps run under torch.profiler; per step, the compiled ops' self time: matmuls (the quantized and
float32 GEMMs, the greedy LM head) and attention (paged attention and the KV write), and "else",
the profiled step's wall time minus those two. The profiler's own cost (~1 us an op event) lands in
"else", and weighs more on the per-op path (~300 op events a step against ~150 fused); medians over
the rounds.

With --cpu-time, also "outside": per decode step, the process CPU time spent outside the compiled
layers' call (``decoder_layers_cpu``) and the LM head (``compute_logits`` / ``greedy_token_ids``),
measured in the timed runs themselves (no replay): embedding lookup, input preparation, sampling,
scheduling, detokenizing (the rotary gathers and the final norm run inside the call since session 13). It does not depend on the replays, which a
contended machine moves more.
``--fused-only`` skips the per-op runs.

With --clock (fused runs only), the breakdown the issue asks for, measured inside the timed decode steps
themselves in wall time: the compiled layers' call times its own phases (``decoder_layers_clock_cpu``: the
linears, the KV write with attention, the rest), the LM head is timed around its call, and "else" is the step's
wall time minus the matmuls (linears + LM head) and attention: the norms (the final one included), rotary and SiLU
inside the call plus everything outside it (embedding lookup, input preparation, argmax, scheduling, detokenizing,
and the Python frames and argument passing around each call). The LM head's time is its Python call's, so its frames
count as matmul: a few microseconds. Run it on a quiet
machine: wall time counts waits for a core.
"""

import argparse
import random
import statistics
import time

import torch

MATMUL_OPS = ("pagedllm::quant_gemm_cpu", "pagedllm::gemm_packed_cpu", "pagedllm::greedy_select_cpu",
              "aten::mm", "aten::addmm", "aten::matmul", "mkl::_mkl_linear")
ATTENTION_OPS = ("pagedllm::paged_attention_cpu", "pagedllm::kv_write_cpu")


class Inside:
    """Process CPU time inside the compiled layers' call (``FusedDecoder._op``: not the Python around
    it) and the LM head, summed while ``on``."""

    def __init__(self, engine) -> None:
        from pagedllm.model.layers import fused_decoder

        self.total, self.on = 0.0, False
        model = engine.core.executor.runner.model
        for owner, name in ((model, "compute_logits"), (model, "greedy_token_ids")):
            setattr(owner, name, self.wrap(getattr(owner, name)))
        real_init = fused_decoder.FusedDecoder.__init__

        def init(decoder, *args, **kwargs):  # built at the model's first step
            real_init(decoder, *args, **kwargs)
            decoder._op = self.wrap(decoder._op)

        fused_decoder.FusedDecoder.__init__ = init

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.process_time() - start
        return timed


class Clocked:
    """Per decode step, in wall time: the compiled call's own phase clock and the LM head's calls."""

    def __init__(self, engine) -> None:
        self.head_s = 0.0
        model = engine.core.executor.runner.model
        for name in ("compute_logits", "greedy_token_ids"):
            setattr(model, name, self.wrap(getattr(model, name)))
        self.clock = torch.ops.pagedllm.decoder_layers_clock_cpu

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.head_s += time.perf_counter() - start
        return timed

    def start(self) -> None:
        self.head_s = 0.0
        self.clock(True)

    def read(self) -> tuple[float, float, float, float]:
        """(linears, attention, the call's other ops, LM head) in ms since ``start``."""
        linear, attention, other, calls = self.clock(False)
        assert calls == 1, f"expected the fused call once a decode step, counted {calls:.0f}"
        return linear * 1e3, attention * 1e3, other * 1e3, self.head_s * 1e3


def clocked_run(engine, args, seed: int, clocked: Clocked) -> list[tuple[float, ...]]:
    """One run's decode steps: (step, linears, attention, other inside the call, LM head) in wall ms."""
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"c{seed}-{i}", {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]},
                           params)
    engine.step()  # the prefill
    rows = []
    while engine.has_unfinished_requests():
        clocked.start()
        start = time.perf_counter()
        engine.step()
        step = (time.perf_counter() - start) * 1e3
        rows.append((step, *clocked.read()))
    return rows


def run(engine, args, seed: int, profile: bool = False, inside: Inside | None = None):
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.batch):
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        engine.add_request(f"r{seed}-{i}", {"prompt_token_ids": ids}, params)
    step_ms, tokens, prof = [], [], None
    inside_ms = []
    first = True
    while engine.has_unfinished_requests():
        if profile and not first and prof is None:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        start, cpu_start = time.perf_counter(), time.process_time()
        if inside is not None:
            inside.total, inside.on = 0.0, not first
        outs = engine.step()
        # profiled steps in wall time, as the profiler times the ops
        cpu = args.cpu_time and not profile
        elapsed = ((time.process_time() - cpu_start) if cpu else (time.perf_counter() - start)) * 1e3
        if not first:
            step_ms.append(elapsed)
            if inside is not None:
                inside_ms.append(inside.total * 1e3)
        first = False
        for out in outs:
            if out.finished:
                tokens.append(list(out.outputs[0].token_ids))
        if prof is not None and len(step_ms) >= args.profile_steps:
            break
    if prof is not None:
        prof.__exit__(None, None, None)
        while engine.has_unfinished_requests():
            engine.step()
        totals = {}
        for event in prof.key_averages():
            totals[event.key] = event.self_cpu_time_total / 1e3  # ms
        n = len(step_ms)
        matmul = sum(totals.get(k, 0.0) for k in MATMUL_OPS) / n
        attention = sum(totals.get(k, 0.0) for k in ATTENTION_OPS) / n
        return step_ms, tokens, (matmul, attention)
    if inside is not None:
        inside.on = False
        return step_ms, tokens, inside_ms
    return step_ms, tokens, None


def cpu_breakdown(engine, args, reps: int = 7) -> tuple[float, float, float]:
    """(matmuls, attention, small ops): process CPU ms of one decode step's matmuls (the 4 linears of
    every layer, by the quantized kernel's entry where quantized, and the LM head), attention (KV write
    + paged attention, every layer) and the fused call's small ops (2 norms, rotary, SiLU a layer)
    alone, replayed on the inputs of the middle decode step of a run (its metadata and KV caches;
    random activations). The replays' own Python calls (~1-3 us each, ~150-270 a replay) count in them.
    Meaningful with --threads 1, where CPU time is the work (with 2, a spinning worker adds to it)."""
    from pagedllm.model.forward_context import get_forward_context

    model = engine.core.executor.runner.model
    captured = []
    real_forward = model.forward

    def capture(input_ids, positions):
        ctx = get_forward_context()
        captured.append((input_ids.shape[0], ctx.attn_metadata, ctx.kv_caches))
        return real_forward(input_ids, positions)

    model.forward = capture  # nn.Module.__call__ looks forward up on the instance
    try:
        run(engine, args, seed=3)
    finally:
        del model.forward
    num_tokens, md, kv_caches = captured[len(captured) // 2]
    layers = model.model.layers
    hidden = layers[0].input_layernorm.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen)
    a0 = layers[0].self_attn
    heads, kv_heads, dim = a0.num_local_heads, a0.num_local_kv_heads, a0.head_dim
    x_o = torch.randn(num_tokens, heads * dim, generator=gen)
    x_down = torch.randn(num_tokens, layers[0].mlp.down_proj.input_size_per_partition, generator=gen)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k, v = torch.randn(2, num_tokens, kv_heads, dim, generator=gen)

    def product(linear):  # the quantized kernel's own entry where there is one: no module frames
        quant = linear.quant_weight
        if quant is None:
            return linear
        bias = linear._parameters.get("bias")
        return lambda inp: quant.matmul(inp, bias)

    products = [(product(layer.self_attn.qkv_proj), product(layer.self_attn.o_proj), product(layer.mlp.gate_up_proj),
                 product(layer.mlp.down_proj)) for layer in layers]

    def matmuls():
        for qkv, o, gate_up, down in products:
            qkv(x), o(x_o), gate_up(x), down(x_down)
        model.compute_logits(x)

    from pagedllm.model.layers import cpu_fused

    ops = cpu_fused.ops()
    qkv_rows = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    gate_up_rows = torch.randn(num_tokens, 2 * x_down.shape[1], generator=gen)
    cos, sin = torch.randn(2, num_tokens, dim, generator=gen)
    norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
    eps = layers[0].input_layernorm.eps

    ns = torch.ops.pagedllm  # the C++ callables, as the fused call reaches them (no Python wrappers)
    add_rms_norm, rotary, silu = (getattr(op.default, "_op", op.default)
                                  for op in (ns.add_rms_norm_cpu, ns.rotary_qk_cpu, ns.silu_and_mul_cpu))
    lanes, block, rotated = ops.norm_lanes, ops.silu_block, heads + kv_heads

    def small_ops():  # what the fused call runs besides matmuls and attention, layer by layer
        for w_in, w_post in norms:
            add_rms_norm(x, x, w_in, eps, lanes)
            rotary(qkv_rows, cos, sin, rotated, dim)
            add_rms_norm(x, x, w_post, eps, lanes)
            silu(gate_up_rows, block)

    def attention():  # writes random K/V into the finished request's slots: nothing reads them again
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attn
            attn.backend.attend(q, k, v, kv_caches[i], md, attn.scale, None, None)

    result = []
    with torch.inference_mode():
        for fn in (matmuls, attention, small_ops):
            fn()
            times = []
            for _ in range(reps):
                start = time.process_time()
                fn()
                times.append((time.process_time() - start) * 1e3)
            result.append(statistics.median(times))
    return tuple(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=24)
    parser.add_argument("--profile-rounds", type=int, default=2)
    parser.add_argument("--fused-only", action="store_true", help="skip the per-op runs")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps by process CPU time, not wall time: with --threads 1 a contended "
                             "machine barely moves it (the steps' own work, without the waits for a core)")
    parser.add_argument("--clock", action="store_true",
                        help="only the in-step breakdown (fused path, wall time): see the module's docstring")
    args = parser.parse_args()

    from pagedllm.config.engine_args import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.layers import fused_decoder

    engine = LLMEngine(EngineArgs(model=None, num_threads=args.threads, enable_prefix_caching=False,
                                  max_num_seqs=max(args.batch, 1)))
    if args.clock:
        clock_breakdown(engine, args)
        return
    modes = {"fused": True} if args.fused_only else {"fused": True, "per-op": False}
    inside = Inside(engine) if args.cpu_time else None
    outside = {m: [] for m in modes}
    steps = {m: [] for m in modes}
    walls = {m: [] for m in modes}
    outputs = {}
    run(engine, args, seed=0)  # warm-up
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for mode in order:
            fused_decoder.set_enabled(modes[mode])
            start = time.perf_counter()
            step_ms, tokens, inside_ms = run(engine, args, seed=1, inside=inside)
            walls[mode].append(time.perf_counter() - start)
            steps[mode].append(statistics.median(step_ms))
            if inside_ms is not None:
                outside[mode].append(statistics.median(s - i for s, i in zip(step_ms, inside_ms)))
            outputs.setdefault(mode, tokens)
    same = outputs["fused"] == outputs["per-op"] if "per-op" in outputs else "(fused only)"
    print(f"default model, batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} greedy tokens, "
          f"{args.threads} threads, {args.rounds} rounds; same tokens fused vs per-op: {same}")
    for mode in modes:
        tok_s = [args.batch * args.max_tokens / w for w in walls[mode]]
        print(f"  {mode:7s} output tok/s (whole run) median {statistics.median(tok_s):.1f} "
              f"[{', '.join(f'{t:.1f}' for t in tok_s)}]; decode step ms ({'CPU' if args.cpu_time else 'wall'}) median {statistics.median(steps[mode]):.2f} "
              f"[{', '.join(f'{s:.2f}' for s in steps[mode])}]")
    if "per-op" in modes:
        ratio = [statistics.median(walls["per-op"]) / statistics.median(walls["fused"]),
                 statistics.median(steps["per-op"]) / statistics.median(steps["fused"])]
        print(f"  fused / per-op speed: {ratio[0]:.2f}x (whole run), {ratio[1]:.2f}x (decode step)")
    shares = {m: [] for m in modes}
    for r in range(args.profile_rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            fused_decoder.set_enabled(modes[mode])
            step_ms, _, (matmul, attention) = run(engine, args, seed=2, profile=True)
            step = sum(step_ms) / len(step_ms)
            shares[mode].append((step, matmul, attention))
    if args.cpu_time:
        matmul, attention, small = cpu_breakdown(engine, args)
        for mode in modes:
            step = statistics.median(steps[mode])
            other = step - matmul - attention
            print(f"  {mode:7s} decode step (CPU) {step:.2f} ms: matmuls {matmul:.2f} ms ({matmul / step:.0%}), "
                  f"attention {attention:.2f} ms ({attention / step:.0%}), else {other:.2f} ms ({other / step:.0%}) "
                  f"[matmuls and attention replayed alone, CPU time]")
            if mode != "fused":
                continue  # the per-op path has no fused call: its layers would count as outside
            out = statistics.median(outside[mode])
            print(f"  {mode:7s} outside the layers' call and the LM head: {out:.2f} ms a step ({out / step:.0%}) "
                  f"[{', '.join(f'{o:.2f}' for o in outside[mode])}]; the call's norms, rotary and SiLU "
                  f"replayed: {small:.2f} ms ({small / step:.0%}); both: {(out + small) / step:.0%}")
    for mode in modes if args.profile_rounds else ():
        step, matmul, attention = (statistics.median(x) for x in zip(*shares[mode]))
        other = step - matmul - attention
        print(f"  {mode:7s} profiled decode step (wall) {step:.2f} ms: matmuls {matmul:.2f} ms ({matmul / step:.0%}), "
              f"attention {attention:.2f} ms ({attention / step:.0%}), else {other:.2f} ms ({other / step:.0%})")
    fused_decoder.set_enabled(None)


def clock_breakdown(engine, args) -> None:
    from pagedllm.model.layers import fused_decoder

    fused_decoder.set_enabled(True)
    clocked = Clocked(engine)
    run(engine, args, seed=0)  # warm-up
    print(f"default model, batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} greedy tokens, "
          f"{args.threads} threads; per decode step, wall ms (median of the run's steps), measured in the steps")
    fractions = []
    for r in range(args.rounds):
        rows = clocked_run(engine, args, seed=10 + r, clocked=clocked)
        step, linear, attention, other, head = (statistics.median(col) for col in zip(*rows))
        # fractions per step, then the median: the medians of the parts need not add up to the step's
        per_step = [((lin + hd) / st, att / st, (st - lin - hd - att) / st, oth / st, (st - lin - hd - att - oth) / st)
                    for st, lin, att, oth, hd in rows]
        matmul_f, attention_f, else_f, other_f, outside_f = (statistics.median(col) for col in zip(*per_step))
        fractions.append(else_f)
        print(f"  round {r + 1}: step {step:.2f} ms; matmuls {matmul_f:.1%} (linears {linear:.2f} + LM head {head:.2f} ms), "
              f"attention {attention_f:.1%} ({attention:.2f} ms), else {else_f:.1%} (of which the call's norms, "
              f"rotary and SiLU {other_f:.1%}, {other:.2f} ms; outside the call {outside_f:.1%})")
    print(f"  else, median over rounds: {statistics.median(fractions):.1%}")
    fused_decoder.set_enabled(None)


if __name__ == "__main__":
    main()
