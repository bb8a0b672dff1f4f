"""The `pagedllm` command: generate, chat, embed, serve, bench, models, worker."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedllm.config import EngineArgs
from pagedllm.errors import PagedLLMError
from pagedllm.sampling_params import SamplingParams


_MODEL_DEFAULT = "default: the model's (--generation-config)"


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling", "A field left unset gets the model's default (--generation-config); "
                                                  "a model without defaults decodes greedily.")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=None, help=f"0 = greedy; {_MODEL_DEFAULT}, else 0")
    group.add_argument("--top-p", type=float, default=None, help=f"{_MODEL_DEFAULT}, else 1")
    group.add_argument("--top-k", type=int, default=None, help=f"{_MODEL_DEFAULT}, else off")
    group.add_argument("--min-p", type=float, default=None, help=f"{_MODEL_DEFAULT}, else 0")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (--seed seeds the engine)")
    group.add_argument("--repetition-penalty", type=float, default=None, help=f"{_MODEL_DEFAULT}, else 1")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("-n", type=int, default=1, help="sequences per prompt")


def _sampling_params(args: argparse.Namespace, model_defaults: dict[str, float | int]) -> SamplingParams:
    """The flags given, over the model's sampling defaults, over greedy decoding (the CLI's own default)."""
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
             if getattr(args, name) is not None}
    fields = {"temperature": 0.0, **model_defaults, **given}
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, seed=args.sampling_seed, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos, **fields,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several are batched together)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="an interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="a system message")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat)

    embed = sub.add_parser("embed", help="print the embeddings of one or more texts as JSON",
                           description="Embed each text with a model served as an embedder (its sentence-transformers "
                                       "pooling, docs/embeddings.md) and print one JSON object: "
                                       '{"model", "data": [{"index", "text", "embedding"}]}.')
    embed.add_argument("texts", nargs="+", help="texts to embed (batched together)")
    embed.add_argument("--dimensions", type=int, default=None, help="Matryoshka models: keep this many values")
    embed.add_argument("--truncate-prompt-tokens", type=int, default=None,
                       help="keep a too-long text's last k tokens (-1: as many as the model takes) instead of failing")
    embed.add_argument("--prompt-name", default=None, help="one of the model's sentence-transformers prompts")
    EngineArgs.add_cli_args(embed)
    embed.set_defaults(runner="pooling")

    sub.add_parser("models", help="list the supported model architectures and how each was verified",
                   description="Each architecture a model directory's config.json may name, and the test that "
                               "checks it against Hugging Face transformers.")

    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(sub.add_parser("serve", help="start the OpenAI-compatible HTTP server"))

    from pagedllm.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from pagedllm.worker.tp_worker import add_worker_args

    add_worker_args(sub.add_parser(
        "worker", help="a tensor-parallel worker joining an engine started elsewhere (multi-host)",
        description="Join the engine whose rendezvous is at --master-addr:--master-port as rank --rank "
                    "of --world-size; the engine sends the model path, which must exist on this host too.",
    ))
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = _sampling_params(args, llm.engine.generation_defaults)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        for completion in output.outputs:
            print(f"--- prompt: {prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]")
            print(completion.text)
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    vectors = llm.embed(args.texts, truncate_prompt_tokens=args.truncate_prompt_tokens, dimensions=args.dimensions,
                        prompt_name=args.prompt_name)
    data = [{"index": i, "text": text, "embedding": vector} for i, (text, vector) in enumerate(zip(args.texts, vectors))]
    print(json.dumps({"model": engine_args.model, "data": data}))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.engine
    params = _sampling_params(args, llm.engine.generation_defaults)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("pagedllm chat — empty line or Ctrl-D to quit", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        request_id = f"chat-{turn}"
        turn += 1
        engine.add_request(request_id, {"prompt_token_ids": llm.encode_chat(messages)}, params, stream=True)
        reply = []
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    for completion in output.outputs:
                        reply.append(completion.text)
                        print(completion.text, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort_request(request_id)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from pagedllm.model.registry import VERIFIED_BY, supported_architectures

    for arch in supported_architectures():
        print(f"{arch}\n    {VERIFIED_BY[arch]}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import cmd_serve as run_serve

    return run_serve(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench.cli import run_bench

    return run_bench(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from pagedllm.worker.tp_worker import run_worker_main

    return run_worker_main(args)  # exits the process when the worker is done


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    commands = {"generate": cmd_generate, "chat": cmd_chat, "embed": cmd_embed, "serve": cmd_serve, "bench": cmd_bench,
                "worker": cmd_worker, "models": cmd_models}
    try:
        return commands[args.command](args)
    except (ValueError, PagedLLMError) as e:  # config, model and request errors: say what is wrong, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
