"""`pagedllm bench moe`: decode steps of a mixture-of-experts model, three ways.

    pagedllm bench moe --batch-sizes 1,16,64 --repeats 5

A random Qwen3-MoE checkpoint of a tiny-but-not-toy shape (default: a Qwen3-30B-A3B scaled down to
hidden 1024, 8 layers, 64 experts of intermediate 384, top-8, 16 query / 4 KV heads of 64, vocab
32000; 691 M parameters, 163 M active per token, 2.8 GB in float32) is written to a temporary
directory and served by an `LLM` (about 2x that in memory: the experts' packed copies). For each
batch size B, B requests of `--context-len` random tokens are prefilled,
then the engine's decode steps (B rows each) are timed with its MoE layers run

    grouped    the engine's path (model/layers/moe.py): rows sorted by expert, each chosen expert's
               GEMMs once over its rows
    dense      every expert over every row, unchosen ones weighted 0 (the naive reference; the
               layers' ``dense`` switch), alternating step by step with grouped, so both see the
               same load from the rest of the machine

and against the matmul-only ideal of the active experts: the rows a grouped step's MoE layers
received (captured by forward hooks) routed again by each layer's router, then only the GEMMs
those routed rows need, each expert once over its rows (trace_efficiency.moe_groups); for the
whole step, that plus every other linear layer at B rows and the LM head. The three run in
rounds (a grouped step, a dense step, the ideal's matmuls), so all see the same load from the rest
of the machine; each time is its fastest of `--repeats` rounds (that load only ever adds time) and
each ratio the median of its per-round ratios (the machine's slow spells fall on both terms).
Random routers spread rows about evenly over the experts; a trained model's routing is more
skewed, so it activates fewer experts per step at B > 1 than reported here.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, int_list, write_result

SHAPE_ARGS = {  # flag -> (Qwen3MoeConfig field, default)
    "hidden": ("hidden_size", 1024),
    "layers": ("num_hidden_layers", 8),
    "experts": ("num_experts", 64),
    "moe_intermediate": ("moe_intermediate_size", 384),
    "top_k": ("num_experts_per_tok", 8),
    "heads": ("num_attention_heads", 16),
    "kv_heads": ("num_key_value_heads", 4),
    "head_dim": ("head_dim", 64),
    "vocab": ("vocab_size", 32000),
}


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "moe", bench_moe, engine=False,
                        help="MoE decode steps: grouped experts vs every expert dense vs the active experts' matmuls")
    for flag, (field, default) in SHAPE_ARGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=default, help=field)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context-len", type=int, default=64, help="prompt tokens of each request")
    p.add_argument("--repeats", type=int, default=5, help="rounds per batch size (grouped step, dense step, ideal)")
    p.add_argument("--model-dir", default=None,
                   help="write (or reuse, if it holds this shape) the random checkpoint here instead of a temp dir")


def shape_config(args):
    from transformers import Qwen3MoeConfig

    fields = {field: getattr(args, flag) for flag, (field, _) in SHAPE_ARGS.items()}
    return Qwen3MoeConfig(**fields, intermediate_size=4 * fields["hidden_size"], decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
                          max_position_embeddings=4096, architectures=["Qwen3MoeForCausalLM"])


def write_random_checkpoint(config, path: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE directory (config, one safetensors shard per layer, an index) of random weights,
    named as transformers saves them; generated layer by layer, so at most one layer is in memory."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    g = torch.Generator().manual_seed(seed)
    H, D, I = config.hidden_size, config.head_dim, config.moe_intermediate_size

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) * in_features**-0.5

    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(path / name))
        weight_map.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": torch.randn(config.vocab_size, H, generator=g),
                                "model.norm.weight": torch.ones(H), "lm_head.weight": linear(config.vocab_size, H)})
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                 p + "self_attn.q_proj.weight": linear(config.num_attention_heads * D, H),
                 p + "self_attn.k_proj.weight": linear(config.num_key_value_heads * D, H),
                 p + "self_attn.v_proj.weight": linear(config.num_key_value_heads * D, H),
                 p + "self_attn.o_proj.weight": linear(H, config.num_attention_heads * D),
                 p + "self_attn.q_norm.weight": torch.ones(D), p + "self_attn.k_norm.weight": torch.ones(D),
                 p + "mlp.gate.weight": linear(config.num_experts, H)}
        for e in range(config.num_experts):
            layer[f"{p}mlp.experts.{e}.gate_proj.weight"] = linear(I, H)
            layer[f"{p}mlp.experts.{e}.up_proj.weight"] = linear(I, H)
            layer[f"{p}mlp.experts.{e}.down_proj.weight"] = linear(H, I)
        shard(f"layer-{i:03d}.safetensors", layer)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


class MoEHooks:
    """Around every sparse-MoE layer of a model: the time spent in them, and (when `capture`) the rows
    each received (forward hooks; `remove` takes them off)."""

    def __init__(self, moes) -> None:
        self.moes = moes
        self.seconds = 0.0
        self.capture = False
        self.inputs: list = []
        self._start = 0.0
        self._handles = [h for m in moes for h in (m.register_forward_pre_hook(self._pre),
                                                   m.register_forward_hook(self._post))]

    def _pre(self, module, args) -> None:
        if self.capture:
            self.inputs.append(args[0].clone())
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _set_dense(moes, dense: bool) -> None:
    for moe in moes:
        moe.dense = dense


def _step(engine, recorder, hooks: MoEHooks, batch_size: int) -> tuple[float, float] | None:
    """(step wall s, s in the MoE layers) of one engine step, or None if it was not a decode of the whole batch."""
    hooks.seconds = 0.0
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    last = recorder.steps[-1]
    return (wall, hooks.seconds) if last.num_seqs == batch_size and last.kind == "decode" else None


class IdealMatmuls:
    """The matmul-only ideal of a decode step whose MoE layers received `moe_inputs` (one [B, hidden]
    per layer, in order): `experts()` runs each layer's router and only the experts its rows are
    routed to, each once over its rows; `rest()` every other linear at B rows and the LM head."""

    def __init__(self, model, moes, moe_inputs) -> None:
        import torch

        from pagedllm.bench.trace_efficiency import linear_modules, moe_groups

        self.model = model
        self.routed = [(moe, x, moe_groups(moe, x)) for moe, x in zip(moes, moe_inputs)]
        batch_size, dtype = moe_inputs[0].shape[0], moe_inputs[0].dtype
        self.linears = linear_modules(model)
        self.inputs = {n: torch.randn(batch_size, n, dtype=dtype) for n in {n for _, n in self.linears}}
        self.head_x = torch.randn(batch_size, model.config.hidden_size, dtype=dtype)
        self.active_per_layer = sum(len(groups) for _, _, groups in self.routed) / len(self.routed)
        self.time()  # warm-up: first touch of the output buffers

    def experts(self) -> None:
        for moe, x, groups in self.routed:
            moe.gate(x)
            for expert, rows in groups:
                moe.expert_mlp(expert, rows)

    def rest(self) -> None:
        for module, n in self.linears:
            module(self.inputs[n])
        from pagedllm.model.layers.greedy_head import GreedyFallback

        if isinstance(self.model.greedy_token_ids(self.head_x), GreedyFallback):
            self.model.compute_logits(self.head_x)

    def time(self) -> tuple[float, float]:
        """(seconds of experts(), seconds of rest()), one run each."""
        import torch

        with torch.inference_mode():
            start = time.perf_counter()
            self.experts()
            middle = time.perf_counter()
            self.rest()
            return middle - start, time.perf_counter() - middle


def run_batch(llm, model, moes, batch_size: int, context_len: int, repeats: int, seed: int) -> dict:
    """One batch size's row: `repeats` rounds of a grouped decode step, a dense one and the ideal's
    matmuls, side by side so that all three see the same load; each figure is its fastest round."""
    import random

    from pagedllm.bench.trace_efficiency import StepRecorder
    from pagedllm.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2 * repeats + 8, ignore_eos=True)
    ids = [f"moe-{batch_size}-{i}" for i in range(batch_size)]
    for req_id in ids:
        engine.add_request(req_id, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context_len)]}, params)
    hooks = MoEHooks(moes)
    rounds = []  # per round: {"grouped": (step s, MoE s), "dense": (...), "ideal": (experts s, rest s)}
    ideal = None
    try:
        with StepRecorder(engine.core) as recorder:
            for _ in range(4 * batch_size * context_len):  # prefill until the whole batch decodes together
                engine.step()
                last = recorder.steps[-1]
                if last.num_seqs == batch_size and last.kind == "decode":
                    break
            for _ in range(repeats):
                timed = {}
                for mode in ("grouped", "dense"):
                    _set_dense(moes, mode == "dense")
                    hooks.capture = mode == "grouped" and ideal is None
                    hooks.inputs = []
                    timed[mode] = _step(engine, recorder, hooks, batch_size)
                    if hooks.capture and timed[mode] is not None:
                        ideal = IdealMatmuls(model, moes, hooks.inputs)
                if ideal is not None and None not in timed.values():
                    rounds.append({**timed, "ideal": ideal.time()})
    finally:
        _set_dense(moes, False)
        hooks.remove()
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    if not rounds:
        raise RuntimeError(f"batch {batch_size}: the batch did not decode together (KV budget too small?)")
    return {"batch_size": batch_size, "active_experts_per_layer": ideal.active_per_layer, **summarize(rounds)}


def summarize(rounds: list[dict]) -> dict:
    """Each figure's fastest round (ms), and each ratio's median over rounds: a ratio within one
    round compares runs seconds apart, so a slow spell of the machine falls on both of its terms."""
    def step(r, mode):
        return r[mode][0] if mode != "ideal" else r["ideal"][0] + r["ideal"][1]

    def moe(r, mode):
        return r[mode][1] if mode != "ideal" else r["ideal"][0]

    out = {"rounds": len(rounds), "per_round_ms": [{mode: [1e3 * t for t in r[mode]] for mode in r} for r in rounds]}
    for key, of in (("step", step), ("moe", moe)):
        out[f"{key}_ms"] = {mode: 1e3 * min(of(r, mode) for r in rounds) for mode in ("grouped", "dense", "ideal")}
        out[f"{key}_ratio"] = {f"{mode}/grouped": statistics.median(of(r, mode) / of(r, "grouped") for r in rounds)
                               for mode in ("dense", "ideal")}
    return out


def moe_table(result: dict) -> tuple[list[str], list[list]]:
    """Milliseconds: fastest round; ratios: median over rounds (summarize)."""
    headers = ["batch", "active experts / layer", "step ms: grouped", "dense", "matmul-only ideal",
               "dense / grouped", "ideal / grouped", "MoE layers ms: grouped", "dense",
               "active experts' GEMMs alone", "dense / grouped", "GEMMs / grouped"]
    rows = []
    for r in result["rows"]:
        s, m, sr, mr = r["step_ms"], r["moe_ms"], r["step_ratio"], r["moe_ratio"]
        rows.append([r["batch_size"], r["active_experts_per_layer"], s["grouped"], s["dense"], s["ideal"],
                     sr["dense/grouped"], sr["ideal/grouped"], m["grouped"], m["dense"], m["ideal"],
                     mr["dense/grouped"], mr["ideal/grouped"]])
    return headers, rows


def bench_moe(args, engine_args: dict | None = None) -> dict:
    import tempfile

    import torch

    from pagedllm.bench.trace_efficiency import moe_layers
    from pagedllm.entrypoints.llm import LLM

    batch_sizes = int_list(args.batch_sizes)
    config = shape_config(args)
    with tempfile.TemporaryDirectory(prefix="pagedllm-moe-") as tmp:
        path = Path(args.model_dir) if args.model_dir else Path(tmp)
        reuse = args.model_dir and (path / "model.safetensors.index.json").exists() and _same_shape(path, config)
        if not reuse:
            start = time.perf_counter()
            write_random_checkpoint(config, path)
            if args.progress:
                print(f"random checkpoint written in {time.perf_counter() - start:.0f} s: {path}")
        max_batch = max(batch_sizes)
        seq_len = args.context_len + 2 * args.repeats + 8
        llm = LLM(model=str(path), max_num_seqs=max_batch, max_model_len=seq_len + 16,
                  num_kv_blocks=max_batch * (-(-seq_len // 16) + 1) + 16, block_size=16,
                  max_num_batched_tokens=max(2048, max_batch))
        try:
            model = llm.engine.core.executor.runner.model  # instrumentation: the layers' dense switch, hooks
            moes = moe_layers(model)
            params = sum(p.numel() for p in model.parameters())
            active_params = params - sum(m.experts.w13.numel() + m.experts.w2.numel() for m in moes) * (
                1 - config.num_experts_per_tok / config.num_experts)
            rows = []
            for b in batch_sizes:
                rows.append(run_batch(llm, model, moes, b, args.context_len, args.repeats, seed=b))
                if args.progress:
                    print(format_table(*moe_table({"rows": rows[-1:]})))
        finally:
            llm.engine.core.shutdown()
    result = {"shape": {flag: getattr(args, flag) for flag in SHAPE_ARGS}, "parameters": params,
              "active_parameters": int(active_params), "dtype": "float32", "context_len": args.context_len,
              "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "rows": rows}
    write_result(Path(args.out), "moe", result)
    print(f"Qwen3-MoE, random weights: {_describe(result)}")
    print(format_table(*moe_table(result)))
    return result


def _same_shape(path: Path, config) -> bool:
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(str(path))  # config.json leaves out fields at their defaults
    return all(getattr(saved, field, None) == getattr(config, field) for field, _ in SHAPE_ARGS.values())


def _describe(result: dict) -> str:
    s = result["shape"]
    return (f"hidden {s['hidden']}, {s['layers']} layers, {s['experts']} experts of intermediate "
            f"{s['moe_intermediate']}, top-{s['top_k']}, {s['heads']} / {s['kv_heads']} heads of {s['head_dim']}, "
            f"vocab {s['vocab']}; {result['parameters'] / 1e6:.0f} M parameters "
            f"({result['active_parameters'] / 1e6:.0f} M active per token), {result['dtype']}, context {result['context_len']}, "
            f"{result['repeats']} rounds, {result['torch_threads']} threads")
