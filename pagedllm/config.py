"""Frozen, validated configs, and the engine arguments they are made from."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory_size(value: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain integers are bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _parse_bool(value: str | bool) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no' (so every engine flag can be passed as --flag VALUE)."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def flag(default, help: str, *, aliases: tuple[str, ...] = (), choices: tuple | None = None,
         parse=None, group: str | None = None, negative: str | None = None, secret: bool = False):
    """A dataclass field whose command-line flag is declared beside it; `add_flags` reads it.

    aliases: more spellings (e.g. "-tp"); parse: turns the flag's text into the value (e.g. a size);
    group: the --help section; negative: a bool's switch-off flag (e.g. "--no-prefix-caching");
    secret: kept out of the dataclass's repr (and so out of logs).
    A field that must not become a flag carries `metadata={"cli": False}` instead.
    """
    metadata = {"help": help, "aliases": aliases, "choices": choices, "parse": parse, "group": group,
                "negative": negative}
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


_FLAG_TYPES = (bool, int, float, str)


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` flag per field of dataclass `cls` whose type the command line can express
    (bool, int, float, str, their Optionals and Literals, or any type with a `parse` in its metadata).

    Defaults come from the fields, so each is declared once; a bool flag takes an optional value
    (`--flag`, `--flag false`).
    """
    hints = typing.get_type_hints(cls)
    groups: dict = {}  # title -> argparse group
    for f in dataclasses.fields(cls):
        meta = f.metadata
        flag_type, choices = _flag_type(hints[f.name])
        parse = meta.get("parse") or flag_type
        if parse is None or meta.get("cli") is False:
            continue  # not expressible as text (an object passed in code), or set elsewhere
        choices = meta.get("choices") or choices
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        group = meta.get("group")
        if group is not None and group not in groups:
            groups[group] = parser.add_argument_group(group)
        target = groups[group] if group is not None else parser
        help_text = (meta.get("help") or "").replace("%", "%%")  # argparse formats help with %
        if default is not None and default != "":
            help_text += f" (default: {_format_default(default, parse)})"
        names = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        if parse is bool:
            target.add_argument(*names, dest=f.name, nargs="?", const=True, default=default, type=_parse_bool,
                                metavar="BOOL", help=help_text)
            if meta.get("negative"):
                target.add_argument(meta["negative"], dest=f.name, action="store_false", default=default,
                                    help=f"same as {names[0]} false")
        else:
            target.add_argument(*names, dest=f.name, type=_flag_parser(parse), default=default,
                                choices=choices, help=help_text)


def _flag_type(hint) -> tuple[type | None, tuple | None]:
    """The flag type of a field's type hint (Optional stripped), and a Literal's choices; None when unsupported."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0]), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        return (members[0] if len(members) == 1 and members[0] in _FLAG_TYPES else None), None
    return (hint if hint in _FLAG_TYPES else None), None


def _format_default(default, parse) -> str:
    """A default as a user would type it: sizes in MiB/GiB rather than bytes."""
    if parse is parse_memory_size and isinstance(default, int):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
            if default >= size and default % size == 0:
                return f"{default // size}{unit}"
    return str(default).lower() if isinstance(default, bool) else str(default)


def _flag_parser(parse):
    """`parse`, with its ValueError shown by argparse as the flag's error message."""
    if parse in _FLAG_TYPES:
        return parse

    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_flag


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """Bytes for the KV cache of all layers (ignored when num_kv_blocks is set)."""
    num_kv_blocks: int | None = None
    """An explicit block count, overriding kv_cache_memory."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV of full blocks shared with earlier requests."""
    preemption_mode: str = "recompute"
    """How a preempted request gets its KV back: 'recompute' it, or 'swap' it out to host memory."""
    swap_space: int = 1 << 30
    """Bytes of host memory for swapped-out blocks (used with preemption_mode='swap')."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) served."""
    scheduling_policy: str = "fcfs"
    """'fcfs': first come, first served; 'priority': lowest `priority` first, then arrival order."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the model scores them all in one step
    and keeps the longest prefix it agrees with (losslessly), plus one token of its own."""

    method: str = "ngram"
    """'ngram': prompt lookup, the tokens that followed the sequence's latest n-gram earlier in its own tokens;
    'draft_model': the greedy guesses of a smaller model with the same vocabulary (`model`)."""
    num_speculative_tokens: int = 3
    """Most tokens proposed per request per step (k); a step yields 1..k+1 tokens."""
    prompt_lookup_min: int = 1
    """Shortest n-gram matched (ngram)."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched (ngram); longer matches are tried first."""
    model: str | None = None
    """draft_model: a smaller Llama-family model with the target's tokenizer (an HF directory or .gguf),
    run greedily by the worker with its own paged KV cache; required for that method, refused otherwise."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('speculative method "draft_model" needs "model": the draft model\'s path')
            if not os.path.exists(os.path.expanduser(self.model)):
                raise ValueError(f"the draft model path {self.model!r} does not exist")
        elif self.model is not None:
            raise ValueError(f'"model" is only read by the "draft_model" method, not {self.method!r}')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A config from a dict or its JSON text (the --speculative-config flag); None/empty = off.
        Unknown keys raise ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = parse_speculative_config(value)
        if not value:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)


def parse_speculative_config(text: str) -> dict:
    """The JSON object of --speculative-config, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    SpeculativeConfig.from_value(value)  # refuse a bad config at parse time
    return value


DISTRIBUTED_SECRET_ENV = "PAGEDLLM_DISTRIBUTED_SECRET"
"""The environment variable holding the tensor-parallel shared secret (preferred to the flag: argv is public)."""
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (tensor parallelism) and how they find each other."""

    tensor_parallel_size: int = 1
    """Ranks, one model shard each (1: the model runs in the engine's process)."""
    master_addr: str = "127.0.0.1"
    """Address of the torch.distributed rendezvous (this host, reachable by every worker)."""
    master_port: int | None = None
    """Port of the rendezvous; None picks a free one."""
    num_local_workers: int | None = None
    """Ranks 0..k-1 are started on this host; the others join with `pagedllm worker`. None: all."""
    distributed_timeout: float = 120.0
    """Seconds a collective, worker start-up or step may wait for a peer before the engine dies."""
    distributed_secret: str | None = dataclasses.field(default=None, repr=False)
    """Shared secret a worker must prove it knows before it may join (HMAC challenge-response).
    Required when workers join from elsewhere; None with only local workers: a random one per engine."""
    data_parallel_size: int = 1
    """Engine replicas behind one front end, each with its own KV cache (and its own TP ranks)."""
    distributed_executor_backend: str = "mp"
    """How replicas are started: "mp" (local processes) or "ray" (Ray actors, restarted when they die)."""
    ray_address: str | None = None
    """The Ray cluster to join (None: RAY_ADDRESS, else a local instance)."""
    ray_max_restarts: int = 3
    """How often Ray restarts one replica that died before it stays down."""
    routing: str = "least-loaded"
    """least-loaded, or prefix-affinity (the replica that last served the prompt's leading blocks)."""
    routing_affinity_blocks: int = 4
    """Leading full blocks of a prompt that prefix-affinity routing hashes."""
    routing_max_imbalance: int = 8
    """Prefix affinity yields to least-loaded when the affine replica has more in-flight sequences than
    the least-loaded one by more than this."""

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.num_local_workers is not None and not 0 <= self.num_local_workers <= tp:
            raise ValueError(f"num_local_workers must be in [0, {tp}], got {self.num_local_workers}")
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.distributed_secret is not None and len(self.distributed_secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the distributed secret must have at least {MIN_SECRET_CHARS} characters")
        if self.num_local < tp and self.distributed_secret is None:
            raise ValueError(
                f"ranks {self.num_local}..{tp - 1} join from other hosts, which needs a shared secret: set "
                f"{DISTRIBUTED_SECRET_ENV} (or --distributed-secret) here and on every worker"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if self.routing not in ("least-loaded", "prefix-affinity"):
            raise ValueError(f"routing must be least-loaded or prefix-affinity, got {self.routing!r}")
        if self.ray_max_restarts < 0 or self.routing_affinity_blocks < 1 or self.routing_max_imbalance < 0:
            raise ValueError("ray_max_restarts and routing_max_imbalance must be >= 0, routing_affinity_blocks >= 1")
        if self.uses_ray and self.num_local < self.tensor_parallel_size:
            raise ValueError("with Ray, every tensor-parallel rank of a replica runs on the replica's node: "
                             "drop --num-local-workers")

    @property
    def uses_ray(self) -> bool:
        return self.distributed_executor_backend == "ray" or self.ray_address is not None

    @property
    def uses_dp_client(self) -> bool:
        """Whether the front end talks to its core(s) through DPCoreClient (several replicas, or Ray)."""
        return self.data_parallel_size > 1 or self.uses_ray

    @property
    def num_local(self) -> int:
        """Ranks started on this host."""
        return self.tensor_parallel_size if self.num_local_workers is None else self.num_local_workers


@dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask for; the front end refuses more with an InvalidRequestError naming
    the limit (HTTP 400). They bound what one request can cost its neighbours per step."""

    max_stop_token_ids: int = 256
    """Most stop_token_ids per request."""
    max_logit_bias: int = 300
    """Most logit_bias entries per request (OpenAI's limit)."""
    max_stop_strings: int = 16
    """Most stop strings per request (at most 64)."""
    max_stop_string_chars: int = 1024
    """Longest stop string, in characters."""
    max_logprobs: int = 20
    """Most top logprobs per generated or prompt token (at most 20)."""
    max_sequences_per_request: int = 256
    """Most sequences one request may generate: prompts x max(n, best_of)."""
    max_prompt_logprobs_positions: int = 2048
    """Longest prompt whose prompt_logprobs may be asked for (one entry per position)."""

    def __post_init__(self) -> None:
        from pagedllm.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        if self.max_stop_strings > MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be <= {MAX_STOP_STRINGS}, got {self.max_stop_strings}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be <= {MAX_LOGPROBS}, got {self.max_logprobs}")


_LIMIT_GROUP = "request limits"
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine; each field is also a CLI flag (`flag()` declares
    its help, aliases and parser beside it; `add_cli_args` turns every field into a flag)."""

    model: str | None = flag(None, "A Hugging Face model directory or a .gguf file (default: the embedded "
                                   "SmolLM2-135M-Instruct).")
    dtype: str = flag("auto", "Weight and activation dtype; auto = float32 on the CPU (bf16 matmuls are far "
                              "slower there), bfloat16 on CUDA.", choices=("auto", "float32", "float16", "bfloat16"))
    gguf_dequantize: bool = flag(False, "Dequantize a GGUF's quantized weights (Q8_0, Q4_0, Q4_1) to float32 at load "
                                        "instead of running them quantized through the compiled CPU kernel.")
    seed: int = flag(0, "Seed of the engine's shared random generator (unseeded sampling).")
    block_size: int = flag(16, "Tokens per KV block.")
    kv_cache_dtype: str = flag("auto", "Element type of the KV cache; auto = the model's dtype. float16 or bfloat16 "
                                       "on a float32 model halves the K/V that attention reads and doubles the "
                                       "blocks that fit in the same memory (lossy: K/V are rounded on write, "
                                       "attention still computes in float32). CPU only when it differs from "
                                       "--dtype.", choices=KV_CACHE_DTYPES)
    kv_cache_memory: int | str = flag(1 << 30, "Bytes for the KV cache of all layers, e.g. 2GiB (ignored when "
                                               "num_kv_blocks is set).", parse=parse_memory_size)
    num_kv_blocks: int | None = flag(None, "An explicit KV block count, overriding kv_cache_memory.")
    enable_prefix_caching: bool = flag(True, "Reuse the cached KV of full blocks shared with earlier requests.",
                                       negative="--no-prefix-caching")
    preemption_mode: str = flag("recompute", "How a preempted request gets its KV back: recompute it, or swap "
                                             "it out to host memory.", choices=("recompute", "swap"))
    swap_space: int | str = flag(1 << 30, "Host memory for swapped-out KV blocks, e.g. 1GiB.", parse=parse_memory_size)
    max_num_seqs: int = flag(128, "Most requests running at once.")
    max_num_batched_tokens: int = flag(2048, "Token budget of one step; longer prompts are prefilled in chunks.")
    max_model_len: int | None = flag(None, "Longest sequence (prompt + output) served; default: the model's "
                                           "context length, capped at 4096.")
    scheduling_policy: str = flag("fcfs", "Order of admission: fcfs (first come, first served) or priority (a "
                                          "request's priority, lower first, then arrival; a waiting request may "
                                          "preempt a running one it outranks when blocks run out).",
                                  choices=SCHEDULING_POLICIES)
    speculative_config: dict | None = flag(None, "Speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                                           "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' (default: off).",
                                           parse=parse_speculative_config)
    device: str = flag("auto", "auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N.", group="device")
    gpu_memory_utilization: float = flag(0.9, "CUDA only: fraction of GPU memory for weights, activations and KV "
                                              "cache; the KV cache gets what a profiling forward pass leaves (the "
                                              "CPU uses kv_cache_memory).", group="device")
    enforce_eager: bool = flag(False, "CUDA only: run decode steps eagerly instead of replaying CUDA graphs.",
                               group="device")
    attention_backend: str = flag("auto", "auto (triton on CUDA; on the CPU the compiled op when it is built, else "
                                          "torch), torch (the PyTorch reference), cpu (the compiled CPU op) or "
                                          "triton.", choices=("auto", "torch", "cpu", "triton"), group="device")
    num_threads: int | None = flag(None, "CPU intra-op threads of the process that runs the model (tensor_parallel_size "
                                         "1); default: torch's, the cores this process may run on.", group="device")

    tensor_parallel_size: int = flag(1, "Worker processes, one model shard each (1: the model runs in the "
                                        "engine's process). With N > 1, kv_cache_memory is each rank's budget "
                                        "for its share of the KV heads.", aliases=("-tp",), group="tensor parallelism")
    master_addr: str = flag("127.0.0.1", "Address of the torch.distributed rendezvous (this host, reachable by "
                                         "every worker).", group="tensor parallelism")
    master_port: int | None = flag(None, "Port of the rendezvous; default: a free one (set it when workers run on "
                                         "other hosts).", group="tensor parallelism")
    num_local_workers: int | None = flag(None, "Ranks 0..k-1 are started here; the others join with `pagedllm "
                                               "worker`. Default: all of them.", group="tensor parallelism")
    distributed_timeout: float = flag(120.0, "Seconds a collective, worker start-up or step may wait for a peer "
                                             "before the engine dies.", group="tensor parallelism")
    distributed_secret: str | None = flag(None, "Shared secret every worker must prove it knows before it joins "
                                                f"(at least {MIN_SECRET_CHARS} characters); required with workers on "
                                                f"other hosts. Prefer the {DISTRIBUTED_SECRET_ENV} environment "
                                                "variable: command lines are visible to other users.",
                                          group="tensor parallelism", secret=True)

    data_parallel_size: int = flag(1, "Engine replicas behind this one server, each with its own KV cache (and "
                                      "its own tensor-parallel ranks); requests are routed by --routing.",
                                   aliases=("-dp",), group="data parallelism")
    distributed_executor_backend: str = flag("mp", "mp: replicas are local processes (a dead one stays down); ray: "
                                                   "Ray actors on the nodes of a Ray cluster, restarted when they die.",
                                             choices=("mp", "ray"), group="data parallelism")
    ray_address: str | None = flag(None, "Join this Ray cluster (implies --distributed-executor-backend ray); default: "
                                         "RAY_ADDRESS, else a local Ray instance.", group="data parallelism")
    ray_max_restarts: int = flag(3, "How often Ray restarts one replica before it stays down.",
                                 group="data parallelism")
    routing: str = flag("least-loaded", "least-loaded (fewest in-flight sequences) or prefix-affinity (the replica "
                                        "that last served the prompt's leading blocks, bounded by load).",
                        choices=("least-loaded", "prefix-affinity"), group="data parallelism")
    routing_affinity_blocks: int = flag(4, "Leading full blocks of a prompt that prefix-affinity routing hashes.",
                                        group="data parallelism")
    routing_max_imbalance: int = flag(8, "Prefix affinity yields to least-loaded when the affine replica has more "
                                         "in-flight sequences than the least-loaded one by more than this.",
                                      group="data parallelism")

    max_stop_token_ids: int = flag(RequestLimits.max_stop_token_ids, "Most stop_token_ids one request may carry.", group=_LIMIT_GROUP)
    max_logit_bias: int = flag(RequestLimits.max_logit_bias, "Most logit_bias entries one request may carry.", group=_LIMIT_GROUP)
    max_stop_strings: int = flag(RequestLimits.max_stop_strings, "Most stop strings one request may carry (at most 64).", group=_LIMIT_GROUP)
    max_stop_string_chars: int = flag(RequestLimits.max_stop_string_chars, "Longest stop string, in characters.", group=_LIMIT_GROUP)
    max_logprobs: int = flag(RequestLimits.max_logprobs, "Most top logprobs per token a request may ask for (at most 20).",
                             group=_LIMIT_GROUP)
    max_sequences_per_request: int = flag(RequestLimits.max_sequences_per_request, "Most sequences one request may generate: prompts x max(n, "
                                               "best_of).", group=_LIMIT_GROUP)
    max_prompt_logprobs_positions: int = flag(RequestLimits.max_prompt_logprobs_positions, "Longest prompt whose prompt_logprobs may be asked for.",
                                              group=_LIMIT_GROUP)

    def __post_init__(self) -> None:
        self.request_limits()  # refuse bad limits when the engine is configured, not at the first request
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        self.speculative()  # refuse a bad speculative_config when the engine is configured
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=parse_memory_size(self.kv_cache_memory),
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            preemption_mode=self.preemption_mode,
            swap_space=parse_memory_size(self.swap_space),
        )

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative-decoding config; None when off."""
        return SpeculativeConfig.from_value(self.speculative_config)

    def request_limits(self) -> RequestLimits:
        return RequestLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RequestLimits)})

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            num_local_workers=self.num_local_workers,
            distributed_timeout=self.distributed_timeout,
            distributed_secret=self.distributed_secret or os.environ.get(DISTRIBUTED_SECRET_ENV) or None,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_address=self.ray_address,
            ray_max_restarts=self.ray_max_restarts,
            routing=self.routing,
            routing_affinity_blocks=self.routing_affinity_blocks,
            routing_max_imbalance=self.routing_max_imbalance,
        )

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_model_len = self.max_model_len if self.max_model_len is not None else min(model_max_len, 4096)
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length ({model_max_len})"
            )
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            scheduling_policy=self.scheduling_policy,
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
