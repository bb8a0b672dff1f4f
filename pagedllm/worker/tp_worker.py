"""A tensor-parallel worker process: one rank, one model shard, one KV-cache shard.

Started by the engine for its local ranks (``python -m pagedllm.worker.tp_worker ...``) or by a
person on another host (``pagedllm worker --master-addr HOST --master-port P --rank R --world-size N``).
Either way it finds the engine through the torch.distributed TCP store at HOST:P, joins the
gloo group, loads only its shard, then runs every step the engine broadcasts (tp_protocol.py).

It exits when told to stop, when a step fails (after reporting the error), or when the engine
goes away (its heartbeat to the store fails, or, for a local worker, its parent changes).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import zmq

from pagedllm import envs
from pagedllm.config import DISTRIBUTED_SECRET_ENV
from pagedllm.worker.host_memory import configure_malloc

logger = logging.getLogger("pagedllm.worker.tp_worker")  # also when run as __main__

HEARTBEAT_INTERVAL_S = 0.5
_DTYPES = ("float32", "float16", "bfloat16")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master-addr", default=None, help="host of the engine's rendezvous store")
    parser.add_argument("--master-port", type=int, default=None, help="port of the engine's rendezvous store")
    parser.add_argument("--distributed-init-method", default=None,
                        help="tcp://HOST:PORT, instead of --master-addr/--master-port")
    parser.add_argument("--rank", type=int, required=True, help="this worker's tensor-parallel rank")
    parser.add_argument("--world-size", type=int, required=True, help="the tensor-parallel size N")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--connect-timeout", type=float, default=300.0,
                        help="seconds to wait for the engine to appear")
    parser.add_argument("--distributed-secret", default=None,
                        help=f"the engine's shared secret (prefer the {DISTRIBUTED_SECRET_ENV} environment "
                             "variable: command lines are visible to other users)")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # local workers


class WorkerRefusedError(Exception):
    """The handshake failed: the engine refused this worker, or the peer does not know the secret."""


def distributed_secret(args: argparse.Namespace) -> str:
    secret = getattr(args, "distributed_secret", None) or envs.PAGEDLLM_DISTRIBUTED_SECRET
    if not secret:
        raise ValueError(f"no shared secret: set {DISTRIBUTED_SECRET_ENV} (or pass --distributed-secret) to the "
                         "engine's --distributed-secret")
    return secret


def _handshake(sock, proto, rank: int, secret: str, timeout_s: float):
    """Prove the secret to the engine and check that it knows it too; returns the engine's next message."""
    nonce = proto.new_nonce()
    sock.send(proto.encoder.encode(proto.HelloMsg(rank, os.getpid(), socket.gethostname(), nonce)))
    challenge = _recv_or_timeout(sock, proto, timeout_s, "a challenge")
    if isinstance(challenge, (proto.StopWorkerMsg, proto.RefusedMsg)):
        return challenge
    if not isinstance(challenge, proto.ChallengeMsg):
        raise WorkerRefusedError(f"expected a challenge from the engine, got {type(challenge).__name__}")
    if not proto.proof_matches(proto.engine_proof(secret, nonce, challenge.nonce), challenge.proof):
        # An empty proof tells a real engine (which then logs the refusal) without helping a false one.
        sock.send(proto.encoder.encode(proto.AuthMsg(rank, b"")))
        raise WorkerRefusedError(f"wrong distributed secret: this worker and the engine do not share it (check "
                                 f"{DISTRIBUTED_SECRET_ENV} or --distributed-secret on both sides)")
    sock.send(proto.encoder.encode(proto.AuthMsg(rank, proto.worker_proof(secret, rank, nonce, challenge.nonce))))
    return _recv_or_timeout(sock, proto, timeout_s, "an InitWorkerMsg")


def _recv_or_timeout(sock, proto, timeout_s: float, what: str):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no reply from the engine within {timeout_s} s (waiting for {what})")
    return proto.to_worker_decoder.decode(sock.recv())


def rendezvous_address(args: argparse.Namespace) -> tuple[str, int]:
    """(host, port) from --distributed-init-method tcp://HOST:PORT or --master-addr/--master-port."""
    if args.distributed_init_method:
        url = urlparse(args.distributed_init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"--distributed-init-method must look like tcp://HOST:PORT, got {args.distributed_init_method!r}")
        return url.hostname, url.port
    if not args.master_addr or args.master_port is None:
        raise ValueError("pass --master-addr and --master-port (or --distributed-init-method tcp://HOST:PORT)")
    return args.master_addr, args.master_port


def _heartbeat(host: str, port: int, rank: int, parent_pid: int | None, stop: threading.Event) -> None:
    """Bump this rank's counter in the engine's store; exit the process if the engine is gone."""
    import torch.distributed as dist

    from pagedllm.worker.tp_protocol import HEARTBEAT_KEY

    key = HEARTBEAT_KEY.format(rank=rank)
    try:
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=10))
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            if parent_pid is not None and os.getppid() != parent_pid:
                raise RuntimeError("the engine process that started this worker is gone")
            store.add(key, 1)
    except Exception as e:  # noqa: BLE001 - any failure here means the engine is unreachable
        if stop.is_set():
            return
        logger.error("rank %d: engine unreachable (%s); exiting", rank, e)
        os._exit(3)


def run_worker(args: argparse.Namespace) -> int:
    """The worker's whole life; returns the exit code."""
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.parallel_state import (
        destroy_tensor_parallel,
        init_tensor_parallel,
        take_collective_error,
    )
    from pagedllm.lora.manager import LoRAManager
    from pagedllm.model import batch_invariant
    from pagedllm.model.loader import load_hf_dir
    from pagedllm.worker import tp_protocol as proto
    from pagedllm.worker.kv_cache import KVCacheSpec
    from pagedllm.worker.kv_cache_sizing import shared_sliding_window
    from pagedllm.worker.model_runner import ModelRunner

    rank = args.rank
    if not 0 <= rank < args.world_size:
        raise ValueError(f"--rank must be in [0, {args.world_size}), got {rank}")
    secret = distributed_secret(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    host, port = rendezvous_address(args)
    logger.info("rank %d/%d: joining the engine at %s:%d", rank, args.world_size, host, port)
    store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=args.connect_timeout))
    engine_address = store.get(proto.ENGINE_ADDRESS_KEY).decode()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    # A random identity: nobody can take this worker's place on the engine's socket by guessing it.
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}-{os.urandom(8).hex()}".encode())
    sock.connect(engine_address)
    stop_heartbeat = threading.Event()
    exit_code = 0
    try:
        init = _handshake(sock, proto, rank, secret, args.connect_timeout)
        if isinstance(init, proto.StopWorkerMsg):
            return 0
        if isinstance(init, proto.RefusedMsg):
            raise WorkerRefusedError(f"the engine refused rank {rank}: {init.reason}")
        assert isinstance(init, proto.InitWorkerMsg), f"expected InitWorkerMsg, got {type(init).__name__}"
        threading.Thread(target=_heartbeat, args=(host, port, rank, args.parent_pid, stop_heartbeat),
                         name="heartbeat", daemon=True).start()

        init_tensor_parallel(rank, args.world_size, dist.PrefixStore(proto.STORE_PREFIX_TP, store), init.timeout_s)
        dtype = getattr(torch, init.dtype)
        gguf_path = None if init.gguf_path is None else Path(init.gguf_path)
        with batch_invariant.building(init.batch_invariant):  # the layers choose their kernels when built
            # only this rank's shard is built and read
            loaded = load_hf_dir(init.model_dir, dtype, gguf_path=gguf_path, quant_activations=init.quant_activations)
        model = loaded.model
        kv_spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, init.block_size, dtype)
        runner = ModelRunner(model, vocab_size=loaded.hf_config.vocab_size, kv_spec=kv_spec,
                             num_blocks=init.num_blocks, seed=init.seed, num_host_blocks=init.num_host_blocks,
                             # ranks run eagerly on the CPU; the mode needs the compiled attention op
                             device="cpu", attention_backend="cpu" if init.batch_invariant else "torch",
                             cuda_graphs=None, load_tokenizer=lambda: loaded.tokenizer, batch_invariant=init.batch_invariant,
                             lora=None if init.lora_slots is None else LoRAManager(model, *init.lora_slots))
        sock.send(proto.encoder.encode(proto.ReadyMsg(rank, model.num_kv_heads, shared_sliding_window(model))))
        logger.info("rank %d: ready (%d KV heads, %d blocks)", rank, model.num_kv_heads, init.num_blocks)

        while True:
            if not sock.poll(1000):
                continue
            msg = proto.to_worker_decoder.decode(sock.recv())
            if isinstance(msg, proto.StopWorkerMsg):
                break
            assert isinstance(msg, proto.ExecuteStepMsg), f"unexpected {type(msg).__name__}"
            output = runner.execute_model(msg.sched)
            error = take_collective_error()
            if error is not None:  # the runner isolated it as a request failure; it is the group's
                raise error
            if rank == 0:
                done = proto.StepDoneMsg(rank, msg.step_id, output=output)
            else:
                done = proto.StepDoneMsg(rank, msg.step_id, sampled_token_ids=output.sampled_token_ids,
                                         kv_spilled=output.kv_spilled or None)
            sock.send(proto.encoder.encode(done))
        destroy_tensor_parallel()
    except WorkerRefusedError as e:
        logger.error("rank %d not admitted: %s", rank, e)
        exit_code = 2
    except Exception as e:  # noqa: BLE001 - report, then exit: the engine decides what it means
        logger.exception("rank %d failed", rank)
        try:
            sock.send(proto.encoder.encode(proto.WorkerErrorMsg(rank, f"{type(e).__name__}: {e}")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        exit_code = 1
    finally:
        stop_heartbeat.set()
        sock.close(linger=2000)  # flush the last message
        ctx.term()
    return exit_code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm worker", description="a tensor-parallel worker")
    add_worker_args(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    sys.exit(run_worker_main(args))


def run_worker_main(args: argparse.Namespace) -> int:
    """Entry point shared by ``python -m`` and ``pagedllm worker``; never returns normally on error."""
    logging.basicConfig(level=str(getattr(args, "log_level", "INFO")).upper(),
                        format=f"%(levelname)s %(name)s [rank {args.rank}]: %(message)s")
    if args.parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when its workers stop
    configure_malloc()  # a rank's model runs here, as the engine core's does (worker/host_memory.py)
    start = time.monotonic()
    try:
        code = run_worker(args)
    except Exception as e:  # noqa: BLE001 - bad arguments, engine never appeared
        logger.error("rank %d: %s: %s", args.rank, type(e).__name__, e)
        code = 2
    logger.info("rank %d: exiting (%d) after %.1f s", args.rank, code, time.monotonic() - start)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a gloo group with dead peers can hang in it


if __name__ == "__main__":
    main()
