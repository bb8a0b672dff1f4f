"""`pagedllm bench embed`: embeddings/s and rerank pairs/s beside sentence-transformers on the same weights.

    pagedllm bench embed --shapes minilm,qwen3-0.6b --num-texts 256 --rounds 3
    pagedllm bench embed --shapes minilm --dtype float32,bf16-matmul,bfloat16   (each beside sentence-transformers, one run)
    pagedllm bench embed --shapes bert-tiny --rerank-shape bert-tiny --num-texts 8 --rounds 1   (a smoke run)

For each shape, a random-weight sentence-transformers model is saved in a temporary directory
(embed_models.py) and both systems embed the same batch of texts of mixed lengths: `LLM.embed` (runner
'pooling') and `SentenceTransformer.encode`, at the same torch thread count. Each system runs in its own
phase, the phases alternate for `--rounds` rounds (the machine's other load then hits both alike), after
an untimed warm-up call each on a few texts; best and median rates are reported. Reranking: `LLM.score`
on query/document pairs vs `CrossEncoder.predict` on a one-label BertForSequenceClassification, the same
way. The vectors and scores of the two systems are compared too (a rate of wrong answers means nothing).

Generation mixed with embeddings in one engine (runner 'both') is `pagedllm bench embed-mixed`
(embed_mixed.py).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result

WARMUP_INPUTS = 8
MIXED_LOAD = "measured by `pagedllm bench embed-mixed` (one engine with --runner both, over HTTP)"


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "embed", bench_embed, engine=False,
                        help="embeddings/s and rerank pairs/s beside sentence-transformers (random weights)")
    p.add_argument("--shapes", default="minilm,qwen3-0.6b",
                   help="embedder shapes, comma-separated: minilm, qwen3-0.6b, bert-tiny, qwen3-tiny")
    p.add_argument("--rerank-shape", default="minilm",
                   help="the cross-encoder's shape (an encoder: minilm, bert-tiny); 'none' skips reranking")
    p.add_argument("--num-texts", type=int, default=256, help="texts in the batch (and pairs to rerank)")
    p.add_argument("--decoder-num-texts", type=int, default=None,
                   help="texts in a decoder shape's batch (default: --num-texts; a 0.6B decoder is ~40x MiniLM's work)")
    p.add_argument("--min-len", type=int, default=8, help="shortest text, in tokens")
    p.add_argument("--max-len", type=int, default=256, help="longest text, in tokens")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each system, alternating")
    p.add_argument("--threads", type=int, default=None, help="torch threads of both systems (default: torch's)")
    p.add_argument("--dtype", default="auto",
                   help="pagedllm's --dtype, or several comma-separated, each an engine timed in the same alternating "
                        "rounds (sentence-transformers stays float32): auto, float32, bf16-matmul, bfloat16. "
                        "bf16-matmul and bfloat16 multiply on AMX tiles where the CPU has them (docs/embeddings.md, "
                        "Speed; elsewhere bfloat16 is ~100x slower)")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch size (its default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagedllm's step budget (default: its own)")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="pagedllm's KV cache for a decoder shape (a pooled request holds its blocks for one step)")
    p.add_argument("--seed", type=int, default=0)


def _rates(seconds: list[float], num_items: int) -> dict:
    return {"seconds": seconds, "best_per_s": num_items / min(seconds),
            "median_per_s": num_items / statistics.median(seconds)}


def _alternate(systems: dict, inputs: list, rounds: int, threads: int) -> tuple[dict[str, list[float]], dict]:
    """Time each system on `inputs` `rounds` times, one phase each per round, after an untimed warm-up call
    on a few inputs (weights paged in, kernels picked); returns the seconds and each system's last answer.
    Both run in this process on torch's intra-op threads; a system that left another thread count behind
    would be timed at it, so that ends the run."""
    import torch

    seconds: dict[str, list[float]] = {name: [] for name in systems}
    answers = {}
    for name, run in systems.items():
        torch.set_num_threads(threads)
        run(inputs[:WARMUP_INPUTS])
    for _ in range(rounds):
        for name, run in systems.items():
            torch.set_num_threads(threads)
            gc.collect()
            start = time.perf_counter()
            answers[name] = run(inputs)
            seconds[name].append(time.perf_counter() - start)
            if torch.get_num_threads() != threads:
                raise SystemExit(f"{name} ran at {torch.get_num_threads()} torch threads, not {threads}")
    return seconds, answers


def _compare(ours, reference) -> dict:
    import numpy as np

    ours, reference = np.asarray(ours, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    result = {"max_abs_diff": float(np.abs(ours - reference).max())}
    if ours.ndim == 2:
        cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
        result["min_cosine"] = float(cosine.min())
    return result


DTYPES = ("auto", "float32", "bf16-matmul", "bfloat16")


def _dtypes(args) -> list[str]:
    dtypes = [d for d in args.dtype.split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if not dtypes or unknown or len(set(dtypes)) != len(dtypes):
        raise SystemExit(f"--dtype: distinct values among {', '.join(DTYPES)}, got {args.dtype!r}")
    return dtypes


def _system_name(dtype: str, args) -> str:
    return "pagedllm" if len(_dtypes(args)) == 1 else f"pagedllm {dtype}"


def _engine(model: Path, args, threads: int, is_decoder: bool, dtype: str):
    from pagedllm import LLM

    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    if is_decoder:  # an encoder keeps no K/V
        # no prefix cache: every round embeds the same texts, which would be cache hits but the last token
        extra.update(kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
    return LLM(str(model), runner="pooling", num_threads=threads, dtype=dtype, **extra)


def bench_embedder(shape_name: str, root: Path, args, threads: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from pagedllm.bench.embed_models import SHAPES, build_embedder, mixed_lengths, texts_of_lengths

    start = time.perf_counter()
    path = build_embedder(shape_name, root, args.seed)
    build_s = time.perf_counter() - start
    num_texts = args.num_texts
    if SHAPES[shape_name].kind != "bert" and args.decoder_num_texts is not None:
        num_texts = args.decoder_num_texts
    lengths = mixed_lengths(num_texts, args.min_len, args.max_len, args.seed)
    texts = texts_of_lengths(SHAPES[shape_name], lengths, args.seed)
    llms = {_system_name(d, args): _engine(path, args, threads, SHAPES[shape_name].kind != "bert", d)
            for d in _dtypes(args)}
    st = SentenceTransformer(str(path), device="cpu")
    systems = {name: llm.embed for name, llm in llms.items()}
    systems["sentence-transformers"] = lambda batch: st.encode(batch, batch_size=args.st_batch_size,
                                                               convert_to_numpy=True)
    seconds, vectors = _alternate(systems, texts, args.rounds, threads)
    num_tokens = sum(len(ids) for ids in next(iter(llms.values())).get_tokenizer()(texts)["input_ids"])
    result = {"shape": shape_name, "num_texts": len(texts), "num_tokens": num_tokens, "build_s": build_s,
              "systems": {name: _rates(s, len(texts)) for name, s in seconds.items()},
              "agreement": {name: _compare(vectors[name], vectors["sentence-transformers"]) for name in llms}}
    del llms, systems, st
    gc.collect()
    return result


def bench_rerank(shape_name: str, root: Path, args, threads: int) -> dict:
    from sentence_transformers.cross_encoder import CrossEncoder

    from pagedllm.bench.embed_models import SHAPES, build_cross_encoder, mixed_lengths, texts_of_lengths

    path = build_cross_encoder(shape_name, root, args.seed)
    shape = SHAPES[shape_name]
    # a short query ([CLS] query [SEP]) beside each document; each pair stays within the model's 512 tokens
    queries = texts_of_lengths(shape, mixed_lengths(args.num_texts, 8, 32, args.seed + 1), args.seed + 1)
    documents = texts_of_lengths(shape, mixed_lengths(args.num_texts, args.min_len, args.max_len, args.seed),
                                 args.seed)
    llms = {_system_name(d, args): _engine(path, args, threads, False, d) for d in _dtypes(args)}
    ce = CrossEncoder(str(path), device="cpu")
    systems = {name: (lambda pairs, llm=llm: llm.score([q for q, _ in pairs], [d for _, d in pairs]))
               for name, llm in llms.items()}
    systems["sentence-transformers"] = lambda pairs: ce.predict(pairs, batch_size=args.st_batch_size,
                                                                convert_to_numpy=True)
    seconds, scores = _alternate(systems, list(zip(queries, documents)), args.rounds, threads)
    result = {"shape": shape_name, "num_pairs": len(documents),
              "systems": {name: _rates(s, len(documents)) for name, s in seconds.items()},
              "agreement": {name: _compare(scores[name], scores["sentence-transformers"]) for name in llms}}
    del llms, systems, ce
    gc.collect()
    return result


def _with_ratios(result: dict) -> dict:
    """Each pagedllm engine's rates over sentence-transformers' (`ratio_best` / `ratio_median`: by engine name)."""
    theirs = result["systems"]["sentence-transformers"]
    ours = {name: rates for name, rates in result["systems"].items() if name != "sentence-transformers"}
    result["ratio_best"] = {name: r["best_per_s"] / theirs["best_per_s"] for name, r in ours.items()}
    result["ratio_median"] = {name: r["median_per_s"] / theirs["median_per_s"] for name, r in ours.items()}
    return result


def bench_embed(args, engine_args: dict) -> dict:
    import torch

    from pagedllm.bench.embed_models import SHAPES

    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in [*shapes, args.rerank_shape] if s not in SHAPES and s != "none"]
    if unknown:
        raise SystemExit(f"unknown shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
    if not 1 <= args.min_len <= args.max_len <= 480:
        raise SystemExit(f"need 1 <= --min-len <= --max-len <= 480 (texts and pairs within 512 tokens), "
                         f"got {args.min_len}..{args.max_len}")
    _dtypes(args)  # refused before any model is built
    threads = args.threads or torch.get_num_threads()
    result: dict = {"threads": threads, "dtype": args.dtype, "lengths": [args.min_len, args.max_len],
                    "rounds": args.rounds, "st_batch_size": args.st_batch_size, "weights": "random",
                    "embed": [], "rerank": None, "mixed_load": MIXED_LOAD}
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-embed-") as tmp:
        for shape in shapes:
            result["embed"].append(_with_ratios(bench_embedder(shape, Path(tmp), args, threads)))
            print(format_rows([result["embed"][-1]], "texts"), flush=True)
        if args.rerank_shape != "none":
            result["rerank"] = _with_ratios(bench_rerank(args.rerank_shape, Path(tmp), args, threads))
    write_result(Path(args.out), "embed", result)
    print(format_result(result))
    return result


def format_rows(rows: list[dict], unit: str) -> str:
    table = []
    for r in rows:
        theirs = r["systems"]["sentence-transformers"]
        for name, agreement in r["agreement"].items():
            ours = r["systems"][name]
            cosine = agreement.get("min_cosine")
            table.append([r["shape"], name, r.get("num_texts", r.get("num_pairs")), ours["best_per_s"],
                          ours["median_per_s"], theirs["best_per_s"], theirs["median_per_s"],
                          f"{r['ratio_best'][name]:.2f}x", f"{r['ratio_median'][name]:.2f}x",
                          "-" if cosine is None else f"{cosine:.7f}", f"{agreement['max_abs_diff']:.1e}"])
    return format_table(["shape", "engine", unit, f"{unit}/s best", "median", f"sentence-transformers {unit}/s best",
                         "median", "ratio best", "ratio median", "min cosine", "max abs diff"], table,
                        floatfmt="{:.1f}")


def format_result(r: dict) -> str:
    lines = [f"{r['threads']} threads, pagedllm dtype {r.get('dtype', 'auto')}, texts of {r['lengths'][0]}..{r['lengths'][1]} tokens, "
             f"{r['rounds']} rounds, random weights", "", "embeddings (LLM.embed vs SentenceTransformer.encode):",
             format_rows(r["embed"], "texts")]
    if r["rerank"]:
        lines += ["", "reranking (LLM.score vs CrossEncoder.predict):", format_rows([r["rerank"]], "pairs")]
    lines += ["", f"generation mixed with embeddings: {r['mixed_load']}"]
    return "\n".join(lines)
