"""The phases of `pagedllm bench llamacpp` (cli_llamacpp.py) and the two ways of running them: both servers up
at once, rounds alternating between them (``side_by_side``), or one server at a time (``one_at_a_time``: for a
file the machine cannot hold twice, the 17 GiB Qwen3-30B-A3B-shaped one on 24 GB)."""

from __future__ import annotations

from pagedllm.bench.common import write_result
from pagedllm.bench.llamacpp import alternate, random_prompts, start_llama_server, start_pagedllm


def fits_twice(file_bytes: int, available_bytes: int | None) -> bool:
    """Whether two servers can each hold the file in memory at once: twice its size within 90% of the memory
    available (None: unknown, assumed so)."""
    return available_bytes is None or 2 * file_bytes <= 0.9 * available_bytes


class Phases:
    """The measured phases, each run against the servers given (one, or several alternating round by round);
    the results are merged into ``result[phase][server name]``."""

    def __init__(self, args, vocab: int, progress) -> None:
        self.args, self.vocab, self.progress = args, vocab, progress

    def warm_up(self, servers, seed: int) -> None:  # first-call costs are not what either server is like
        alternate(servers, 1, lambda r: random_prompts(1, self.args.prompt_len, self.vocab, seed=seed), 8)

    def one_user(self, servers, result: dict) -> None:
        a = self.args
        self.warm_up(servers, 10**6)
        print(f"single user ({', '.join(s.name for s in servers)}; llama-server --parallel 1): {a.rounds} rounds, "
              f"{a.prompt_len}-token prompt, {a.output_len} output tokens")
        prompts = lambda r: random_prompts(1, a.prompt_len, self.vocab, seed=r)  # noqa: E731
        _merge(result, "single", alternate(servers, a.rounds, prompts, a.output_len, self.progress))
        if a.ttft_prompt_len > 0:
            print(f"time to first token: {a.rounds} rounds, {a.ttft_prompt_len}-token prompt")
            _merge(result, "ttft", alternate(servers, a.rounds, lambda r: random_prompts(1, a.ttft_prompt_len,
                                                                                          self.vocab, seed=500 + r), 1))

    def at_once(self, servers, result: dict) -> None:
        a = self.args
        self.warm_up(servers, 10**6 + 1)
        print(f"{a.concurrency} at once ({', '.join(s.name for s in servers)}; llama-server --parallel "
              f"{max(a.concurrency, 1)}): {a.concurrent_rounds} rounds")
        _merge(result, "concurrent", alternate(
            servers, a.concurrent_rounds,
            lambda r: random_prompts(a.concurrency, a.prompt_len, self.vocab, seed=1000 + r), a.output_len,
            self.progress))


def _merge(result: dict, phase: str, by_server: dict) -> None:
    result.setdefault(phase, {}).update(by_server)


def side_by_side(phases: Phases, result: dict, binary, model, one_user_tokens, kv_tokens, slots, out,
                 pagedllm_args, extra_llama) -> dict:
    """Both servers up at once, rounds alternating; llama-server restarted with N slots for the batch."""
    a = phases.args
    pagedllm = start_pagedllm(model, a.threads, int(result["pagedllm_kv_mib"] * 2**20), out, pagedllm_args)
    llama = llama_one = llama_batch = None
    try:
        llama = start_llama_server(binary, model, a.threads, one_user_tokens, 1, out, extra_llama)
        result["memory_after_load"] = {s.name: s.memory() for s in (pagedllm, llama)}
        phases.one_user([pagedllm, llama], result)
        llama_one = llama.memory()
        llama.stop()
        llama = None
        write_result(out, "llamacpp-partial", result)  # the concurrent phase can take long on a busy machine
        if a.concurrency > 0:
            llama = start_llama_server(binary, model, a.threads, kv_tokens, slots, out, extra_llama)
            phases.at_once([pagedllm, llama], result)
            llama_batch = llama.memory()
        return {"pagedllm": pagedllm.memory(), "llama.cpp": _larger(llama_one, llama_batch)}
    finally:
        for s in (pagedllm, llama):
            if s is not None:
                s.stop()


def one_at_a_time(phases: Phases, result: dict, binary, model, one_user_tokens, kv_tokens, slots, out,
                  pagedllm_args, extra_llama) -> dict:
    """pagedllm alone (one user, then the batch), then llama-server --parallel 1, then --parallel N: each
    stopped before the next starts, so the machine holds one copy of the weights at a time."""
    a = phases.args
    result["memory_after_load"] = {}
    server = start_pagedllm(model, a.threads, int(result["pagedllm_kv_mib"] * 2**20), out, pagedllm_args)
    try:
        result["memory_after_load"]["pagedllm"] = server.memory()
        phases.one_user([server], result)
        if a.concurrency > 0:
            phases.at_once([server], result)
        pagedllm_memory = server.memory()
    finally:
        server.stop()
    write_result(out, "llamacpp-partial", result)
    server = start_llama_server(binary, model, a.threads, one_user_tokens, 1, out, extra_llama)
    try:
        result["memory_after_load"]["llama.cpp"] = server.memory()
        phases.one_user([server], result)
        llama_one = server.memory()
    finally:
        server.stop()
    llama_batch = None
    if a.concurrency > 0:
        server = start_llama_server(binary, model, a.threads, kv_tokens, slots, out, extra_llama)
        try:
            phases.at_once([server], result)
            llama_batch = server.memory()
        finally:
            server.stop()
    return {"pagedllm": pagedllm_memory, "llama.cpp": _larger(llama_one, llama_batch)}


def _larger(*memories) -> dict:
    return max((m for m in memories if m), key=lambda m: m["peak_mib_total"])
