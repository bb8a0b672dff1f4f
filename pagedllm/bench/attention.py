"""Attention per layer call: the compiled CPU op, the torch reference, SDPA on contiguous K/V,
and the floor set by reading the KV cache at this machine's measured memory bandwidth.

Every method gets the same queries, keys and values (default model shapes: 9 query heads,
3 KV heads, head_dim 64, block 16; every sequence at the stated length). The paged methods read
a ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache whose blocks are randomly
permuted; "contiguous SDPA" holds each sequence's K/V as one dense tensor (at decode, each KV
head's query group folded into the query axis, the faster form). Outputs are checked equal.

The KV-read floor is the bytes a step must read (every sequence's K and V once) over the read
bandwidth measured in the same run (a multi-threaded sum over a tensor far larger than the
caches). A mixed step (63 decodes at 512 + one 512-token prompt chunk) is timed beside its
decode part and its chunk run apart. Times are minima over interleaved rounds (the machine may be
shared); torch uses one thread per core.

With ``kv_cache_dtype`` (``--kv-cache-dtype float16`` or ``bfloat16``) each shape also times the op
and the reference on a 16-bit copy of the same cache, in the same rounds, beside the floor for
the 16-bit cache's bytes (half the float32 floor).

With ``scattered_gb`` (``--scattered``) each shape also times the op as the engine's decode steps
see it: the sequences' blocks are placed at random through one cache of that size on huge pages
(``pagedllm.model.huge_pages``, as the engine allocates its caches), with a different random block
set per layer for ``SCATTERED_LAYERS`` layers called in turn, so no layer finds its K/V in any
cache level. The bench's own case reads one small cache again and again, hot in L3.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.nn.functional as F

from pagedllm.model import huge_pages
from pagedllm.model.attention import cpu_op
from pagedllm.model.attention.backend import CpuAttentionBackend
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.attention.paged import paged_attention

DEFAULT_SHAPES = [("decode", 32, 512), ("decode", 64, 256), ("decode", 64, 512), ("decode", 32, 1024),
                  ("prefill", 1, 512), ("prefill", 4, 256)]
MIXED = (63, 512, 512)  # decodes, their context, prompt chunk length
SCATTERED_LAYERS = 30  # the default model's layer count


def _min_times(fns: dict, rounds: int) -> dict[str, float]:
    """Seconds per call of each fn: the minimum over ``rounds`` interleaved rounds."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def read_bandwidth(rounds: int = 5, nbytes: int = 1 << 29) -> float:
    """Bytes/s this machine reads with all threads (sum over a tensor far larger than the caches)."""
    x = torch.ones(nbytes // 4)
    t = _min_times({"sum": lambda: x.sum()}, rounds)["sum"]
    return nbytes / t


class _Case:
    """Sequences with K/V both dense and scattered into randomly permuted cache blocks."""

    def __init__(self, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.scale = head_dim**-0.5
        self.keys = [torch.randn(num_kv_heads, s, head_dim, generator=g) for s in seq_lens]
        self.values = [torch.randn(num_kv_heads, s, head_dim, generator=g) for s in seq_lens]
        self.queries = [torch.randn(q, num_heads, head_dim, generator=g) for q in query_lens]
        nblocks = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(nblocks)
        self.kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables = [[perm.pop() for _ in range(n)] for n in nblocks]
        flat = self.kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        for table, k, v in zip(tables, self.keys, self.values):
            pos = torch.arange(k.shape[1])
            slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            flat[0, slots] = k.transpose(0, 1)
            flat[1, slots] = v.transpose(0, 1)
        width = max(nblocks)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.metadata = AttentionMetadata(
            slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),  # unused: K/V already written
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
            query_lens_host=list(query_lens), seq_lens_host=list(seq_lens),
        )
        self.query = torch.cat(self.queries)
        self.kv_bytes = sum(2 * k.numel() * 4 for k in self.keys)

    def op(self, kv_cache: torch.Tensor | None = None):
        return cpu_op.paged_attention_cpu(self.query, self.kv_cache if kv_cache is None else kv_cache,
                                          self.metadata, self.scale)

    def backend(self):
        """What the engine runs on the CPU: the cpu backend (the op, or the reference for inputs it lacks)."""
        return CpuAttentionBackend().forward(self.query, self.kv_cache, self.metadata, self.scale)

    def reference(self):
        return paged_attention(self.query, self.kv_cache, self.metadata, self.scale)


def _contiguous_sdpa(case: _Case, phase: str):
    """SDPA over dense K/V, all sequences of one length: one batched call."""
    key, value = torch.stack(case.keys), torch.stack(case.values)  # [S, Hkv, L, D]
    num_seqs, num_kv_heads, _, head_dim = key.shape
    if phase == "decode":
        q = case.query.view(num_seqs, num_kv_heads, -1, head_dim)  # [S, Hkv, G, D]
        return lambda: F.scaled_dot_product_attention(q, key, value, scale=case.scale)
    q = torch.stack(case.queries).transpose(1, 2)  # [S, H, L, D]
    return lambda: F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=case.scale,
                                                  enable_gqa=True)


def _scattered_op(case: _Case, cache: torch.Tensor, layers: int, expected: torch.Tensor):
    """A callable running the op over ``layers`` random block sets of ``cache`` in turn (layer 0's
    blocks hold the case's K/V; its output is checked against ``expected``)."""
    num_blocks = case.kv_cache.shape[1]
    sets = [torch.randperm(cache.shape[1])[:num_blocks] for _ in range(layers)]
    cache[:, sets[0]] = case.kv_cache
    metas = [dataclasses.replace(case.metadata, block_tables=s[case.metadata.block_tables]) for s in sets]
    torch.testing.assert_close(cpu_op.paged_attention_cpu(case.query, cache, metas[0], case.scale), expected,
                               rtol=1e-4, atol=1e-4)

    def run():
        for meta in metas:
            cpu_op.paged_attention_cpu(case.query, cache, meta, case.scale)

    return run


def compare(phase: str, num_seqs: int, seq_len: int, bandwidth: float, rounds: int = 10, num_heads: int = 9,
            num_kv_heads: int = 3, head_dim: int = 64, block_size: int = 16, seed: int = 0,
            kv_cache_dtype: torch.dtype | None = None, scattered_cache: torch.Tensor | None = None) -> dict:
    """One shape: `decode` (1 query per sequence over seq_len keys) or `prefill` (seq_len causal queries);
    with kv_cache_dtype, also the op and the reference over that narrower copy of the cache; with
    scattered_cache (a large float32 cache of this shape's block layout), also the op over blocks
    scattered through it, a different set per layer."""
    num_q = 1 if phase == "decode" else seq_len
    case = _Case([seq_len] * num_seqs, [num_q] * num_seqs, num_heads, num_kv_heads, head_dim, block_size, seed)
    fns = {"reference": case.reference, "contiguous": _contiguous_sdpa(case, phase)}
    if cpu_op.load():
        fns["op"] = case.op
    narrow = None
    if kv_cache_dtype is not None:
        kv16 = case.kv_cache.to(kv_cache_dtype)
        fns["reference16"] = lambda: paged_attention(case.query, kv16, case.metadata, case.scale)
        if cpu_op.load():
            fns["op16"] = lambda: case.op(kv16)
    with torch.inference_mode():
        if kv_cache_dtype is not None:
            expected16 = fns["reference16"]()
            if "op16" in fns:
                torch.testing.assert_close(fns["op16"](), expected16, rtol=1e-4, atol=1e-4)
        expected = case.reference()
        for name in ("contiguous", "op"):
            if name in fns:
                out = fns[name]()
                if name == "contiguous":
                    out = out.reshape(num_seqs, num_heads, num_q, head_dim).transpose(1, 2).reshape(expected.shape)
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        if scattered_cache is not None and "op" in fns:
            fns["scattered"] = _scattered_op(case, scattered_cache, SCATTERED_LAYERS, expected)
        t = _min_times(fns, rounds)
    if kv_cache_dtype is not None:
        kv_bytes = case.kv_bytes * kv_cache_dtype.itemsize // 4
        narrow = {"kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
                  "op_ms": 1e3 * t["op16"] if "op16" in t else None, "reference_ms": 1e3 * t["reference16"],
                  "kv_mb": kv_bytes / 1e6, "floor_ms": 1e3 * kv_bytes / bandwidth}
    scattered = None
    if "scattered" in t:
        scattered = {"op_ms": 1e3 * t["scattered"] / SCATTERED_LAYERS, "layers": SCATTERED_LAYERS,
                     "cache_gb": scattered_cache.numel() * 4 / 2**30}
    return {"phase": phase, "num_seqs": num_seqs, "seq_len": seq_len, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "op_ms": 1e3 * t["op"] if "op" in t else None, "reference_ms": 1e3 * t["reference"],
            "contiguous_ms": 1e3 * t["contiguous"], "kv_mb": case.kv_bytes / 1e6,
            "floor_ms": 1e3 * case.kv_bytes / bandwidth, "narrow_kv": narrow, "scattered": scattered}


def compare_mixed(num_decodes: int = 63, context: int = 512, chunk: int = 512, rounds: int = 10,
                  num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64, block_size: int = 16) -> dict:
    """A mixed step vs its decode part and its prompt chunk run apart, through the op and the reference."""
    shape = (num_heads, num_kv_heads, head_dim, block_size, 0)
    mixed = _Case([context] * num_decodes + [chunk], [1] * num_decodes + [chunk], *shape)
    decode = _Case([context] * num_decodes, [1] * num_decodes, *shape)
    prompt = _Case([chunk], [chunk], *shape)
    fns = {"ref_mixed": mixed.reference, "ref_decode": decode.reference, "ref_chunk": prompt.reference,
           "chunk_sdpa": _contiguous_sdpa(prompt, "prefill")}
    if cpu_op.load():
        fns.update(op_mixed=mixed.op, op_decode=decode.op, op_chunk=prompt.op,
                   backend_mixed=mixed.backend, backend_decode=decode.backend, backend_chunk=prompt.backend)
    with torch.inference_mode():
        if "op_mixed" in fns:
            torch.testing.assert_close(mixed.op(), mixed.reference(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mixed.backend(), mixed.reference(), rtol=1e-4, atol=1e-4)
        t = _min_times(fns, rounds)
    return {"num_decodes": num_decodes, "context": context, "chunk": chunk,
            **{f"{name}_ms": 1e3 * sec for name, sec in t.items()}}


def run_attention(shapes=DEFAULT_SHAPES, repeats: int = 10, progress: bool = True, mixed=MIXED,
                  kv_cache_dtype: str | None = None, scattered_gb: float | None = None, **model_shape) -> dict:
    """Every shape, the mixed step and the bandwidth; ``repeats`` = interleaved rounds per shape.
    ``kv_cache_dtype`` ('float16' or 'bfloat16'): each shape also over a cache of that type.
    ``scattered_gb``: each shape also over blocks scattered through a cache of that many GiB."""
    narrow = None
    if kv_cache_dtype not in (None, "", "auto", "float32"):
        if kv_cache_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got {kv_cache_dtype!r}")
        narrow = getattr(torch, kv_cache_dtype)
    from tqdm.auto import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        bandwidth = read_bandwidth()
        cache = None
        if scattered_gb:
            block = (model_shape.get("block_size", 16), model_shape.get("num_kv_heads", 3),
                     model_shape.get("head_dim", 64))
            num_blocks = max(1, int(scattered_gb * 2**30) // (2 * 4 * block[0] * block[1] * block[2]))
            cache = huge_pages.zeros((2, num_blocks, *block))
        rows = [compare(phase, s, l, bandwidth, rounds=repeats, kv_cache_dtype=narrow, scattered_cache=cache,
                        **model_shape)
                for phase, s, l in tqdm(shapes, desc="attention", disable=not progress)]
        del cache
        mixed_row = compare_mixed(*mixed, rounds=repeats) if mixed else None
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "mixed": mixed_row, "read_gb_s": bandwidth / 1e9, "threads": os.cpu_count(),
            "kernel": cpu_op.isa_name()}


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def attention_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["phase", "seqs", "seq len", "compiled op ms", "torch ref ms", "contiguous SDPA ms",
               "KV-read floor ms", "op / SDPA", "op / floor"]
    rows = []
    for r in result["rows"]:
        rows.append([r["phase"], r["num_seqs"], r["seq_len"], r.get("op_ms") if r.get("op_ms") is not None else "-",
                     r["reference_ms"], r["contiguous_ms"], r["floor_ms"],
                     _ratio(r.get("op_ms"), r["contiguous_ms"]), _ratio(r.get("op_ms"), r["floor_ms"])])
        n = r.get("narrow_kv")
        if n:  # the same shape over a 16-bit cache: SDPA stays float32; the floor is the 16-bit bytes
            rows.append([f"  {n['kv_cache_dtype']} KV (op / f32 op {_ratio(n['op_ms'], r.get('op_ms'))})",
                         r["num_seqs"], r["seq_len"], n["op_ms"] if n["op_ms"] is not None else "-",
                         n["reference_ms"], r["contiguous_ms"], n["floor_ms"],
                         _ratio(n["op_ms"], r["contiguous_ms"]), _ratio(n["op_ms"], n["floor_ms"])])
        sc = r.get("scattered")
        if sc:  # the engine's case: every layer's blocks elsewhere in a large cache, none of them hot
            rows.append([f"  scattered: {sc['layers']} layers' blocks in {sc['cache_gb']:.3g} GiB (op / hot op "
                         f"{_ratio(sc['op_ms'], r.get('op_ms'))})", r["num_seqs"], r["seq_len"], sc["op_ms"], "-",
                         r["contiguous_ms"], r["floor_ms"], _ratio(sc["op_ms"], r["contiguous_ms"]),
                         _ratio(sc["op_ms"], r["floor_ms"])])
    m = result.get("mixed")
    if m:
        label = f"{m['num_decodes']} decodes @{m['context']} + {m['chunk']} chunk"
        ref_apart = m["ref_decode_ms"] + m["ref_chunk_ms"]
        rows.append([f"mixed step: {label}, torch ref", m["num_decodes"] + 1, m["context"], "-", m["ref_mixed_ms"],
                     "-", "-", f"vs apart {_ratio(m['ref_mixed_ms'], ref_apart)}", ""])
        for kind, what in (("op", "compiled op (one varlen call)"), ("backend", "cpu backend (what the engine runs)")):
            if m.get(f"{kind}_mixed_ms") is None:
                continue
            mixed, dec, chunk = m[f"{kind}_mixed_ms"], m[f"{kind}_decode_ms"], m[f"{kind}_chunk_ms"]
            rows.append([f"mixed step: {label}, {what}", m["num_decodes"] + 1, m["context"], mixed, "-", "-", "-",
                         f"vs apart {_ratio(mixed, dec + chunk)}", ""])
            rows.append([f"  {what}: decode part alone", m["num_decodes"], m["context"], dec, "-", "-", "-", "", ""])
            rows.append([f"  {what}: chunk alone", 1, m["chunk"], chunk, "-", m["chunk_sdpa_ms"], "-",
                         _ratio(chunk, m["chunk_sdpa_ms"]), ""])
    return headers, rows
