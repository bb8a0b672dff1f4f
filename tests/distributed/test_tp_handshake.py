"""The tensor-parallel control plane's shared secret: both ends prove it (HMAC challenge-response)
before a worker joins; impostors and peers that never joined are refused or ignored. No model here:
the engine side is the executor's start-up against fake workers on loopback sockets."""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from pagedllm.worker import tp_protocol as proto
from pagedllm.worker.tp_executor import MultiprocTPExecutor, _WorkerFailure
from pagedllm.worker.tp_worker import WorkerRefusedError, _handshake, distributed_secret

SECRET = "the-shared-secret-0123"


def _bare_executor(tp_size: int, secret: str):
    """A MultiprocTPExecutor with only its control socket: what _start needs."""
    ex = MultiprocTPExecutor.__new__(MultiprocTPExecutor)
    ex.tp_size, ex.timeout_s, ex._secret = tp_size, 20.0, secret
    ex._identities, ex.procs, ex._heartbeats, ex._last_liveness_check = {}, {}, {}, 0.0
    ex._ctx = zmq.Context()
    ex._sock = ex._ctx.socket(zmq.ROUTER)
    ex._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = ex._sock.bind_to_random_port("tcp://127.0.0.1")
    return ex, f"tcp://127.0.0.1:{port}"


def _dealer(ctx, address: str, identity: bytes):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_the_engine_admits_only_workers_that_prove_the_secret():
    ex, address = _bare_executor(2, SECRET)
    ctx = zmq.Context()
    results: dict[str, object] = {}

    def worker(name: str, rank: int, secret: str):
        sock = _dealer(ctx, address, f"rank{rank}-{name}".encode())
        try:
            msg = _handshake(sock, proto, rank, secret, 20.0)
            results[name] = msg
            if isinstance(msg, proto.InitWorkerMsg):
                sock.send(proto.encoder.encode(proto.ReadyMsg(rank, num_kv_heads=2)))
                results[name + ".next"] = proto.to_worker_decoder.decode(sock.recv())  # the stop at shutdown
        except WorkerRefusedError as e:
            results[name] = e
        finally:
            sock.close()

    def squatter():
        """Never joins, sends what a worker would send later: must be ignored, not believed."""
        sock = _dealer(ctx, address, b"rank1-squatter")
        sock.send(proto.encoder.encode(proto.ReadyMsg(1, num_kv_heads=99)))
        sock.send(proto.encoder.encode(proto.WorkerErrorMsg(0, "fake failure")))
        sock.send(b"not msgpack at all")
        time.sleep(0.5)
        sock.close()

    engine = threading.Thread(target=ex._start,
                              args=("/model", "float32", SimpleNamespace(block_size=4, num_kv_heads=2), 8, 0, 0))
    engine.start()
    impostor = threading.Thread(target=worker, args=("impostor", 1, "not-the-secret-0000"))
    impostor.start()
    squat = threading.Thread(target=squatter)
    squat.start()
    impostor.join(20)
    squat.join(20)
    good = [threading.Thread(target=worker, args=(f"good{r}", r, SECRET)) for r in (0, 1)]
    for t in good:
        t.start()
    engine.join(20)
    assert not engine.is_alive()
    ex._launched, ex._closed, ex.failure = True, False, None
    ex._finalizer = SimpleNamespace(detach=lambda: None)
    ex.shutdown()
    for t in good:
        t.join(20)
    ctx.term()

    assert isinstance(results["impostor"], WorkerRefusedError)
    assert "wrong distributed secret" in str(results["impostor"])
    assert all(isinstance(results[f"good{r}"], proto.InitWorkerMsg) for r in (0, 1))
    assert all(isinstance(results[f"good{r}.next"], proto.StopWorkerMsg) for r in (0, 1))
    assert sorted(ex._identities) == [0, 1] and all(b"good" in i for i in ex._identities.values())


def test_an_engine_that_refuses_a_wrong_proof_says_why():
    """The engine side of a wrong secret: the worker proves the engine right, then sends a bad proof."""
    ex, address = _bare_executor(1, SECRET)
    ctx = zmq.Context()
    sock = _dealer(ctx, address, b"rank0-x")
    nonce = proto.new_nonce()
    sock.send(proto.encoder.encode(proto.HelloMsg(0, 1, "host", nonce)))

    replies = []

    def engine():
        with pytest.raises(_WorkerFailure, match=r"rank\(s\) 0 did not reply"):
            ex._start("/model", "float32", SimpleNamespace(block_size=4, num_kv_heads=1), 8, 0, 0)

    ex.timeout_s = 2.0
    t = threading.Thread(target=engine)
    t.start()
    challenge = proto.to_worker_decoder.decode(sock.recv())
    assert proto.proof_matches(proto.engine_proof(SECRET, nonce, challenge.nonce), challenge.proof)
    sock.send(proto.encoder.encode(proto.AuthMsg(0, proto.worker_proof("wrong-secret-wrong", 0, nonce,
                                                                        challenge.nonce))))
    replies.append(proto.to_worker_decoder.decode(sock.recv()))
    t.join(10)
    sock.close()
    ex._sock.close(linger=0)
    ctx.term()
    ex._ctx.term()
    assert replies == [proto.RefusedMsg("wrong distributed secret")]
    assert ex._identities == {}


def test_a_worker_refuses_an_engine_that_does_not_know_the_secret():
    ctx = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)
    port = engine.bind_to_random_port("tcp://127.0.0.1")
    worker = _dealer(ctx, f"tcp://127.0.0.1:{port}", b"rank0-w")
    outcome = {}

    def run():
        try:
            _handshake(worker, proto, 0, SECRET, 10.0)
        except WorkerRefusedError as e:
            outcome["error"] = e

    t = threading.Thread(target=run)
    t.start()
    ident, payload = engine.recv_multipart()
    hello = proto.from_worker_decoder.decode(payload)
    fake_nonce = proto.new_nonce()
    engine.send_multipart([ident, proto.encoder.encode(
        proto.ChallengeMsg(fake_nonce, proto.engine_proof("guessed-secret-000", hello.nonce, fake_nonce)))])
    _, payload = engine.recv_multipart()
    t.join(10)
    auth = proto.from_worker_decoder.decode(payload)
    assert auth == proto.AuthMsg(0, b"")  # nothing that depends on the secret goes to a false engine
    assert "wrong distributed secret" in str(outcome["error"])
    worker.close()
    engine.close(linger=0)
    ctx.term()


def test_a_worker_needs_a_secret(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_DISTRIBUTED_SECRET", raising=False)
    with pytest.raises(ValueError, match="no shared secret: set PAGEDLLM_DISTRIBUTED_SECRET"):
        distributed_secret(argparse.Namespace(distributed_secret=None))
    monkeypatch.setenv("PAGEDLLM_DISTRIBUTED_SECRET", SECRET)
    assert distributed_secret(argparse.Namespace(distributed_secret=None)) == SECRET
    assert distributed_secret(argparse.Namespace(distributed_secret="flag-secret")) == "flag-secret"


def test_proofs_bind_the_role_rank_and_both_nonces():
    a, b = proto.new_nonce(), proto.new_nonce()
    proof = proto.worker_proof(SECRET, 1, a, b)
    assert proto.proof_matches(proof, proto.worker_proof(SECRET, 1, a, b))
    for other in (proto.worker_proof(SECRET, 2, a, b), proto.worker_proof(SECRET, 1, b, a),
                  proto.worker_proof(SECRET + "x", 1, a, b), proto.engine_proof(SECRET, a, b)):
        assert not proto.proof_matches(proof, other)
