"""The KV block map on a busy engine, per published map: the engine core's build and encode time (a step
listener times `core.kv_map()`), then the API server's share of the same map: decoding the core's message
that carries it and encoding the dashboard's event (the JSON the page reads). The default model, 32 requests
of 200 prompt tokens decoding 64 each.

    PYTHONPATH=$PWD .venv/bin/python scripts/kv_map_step_cost.py
"""
import time

import msgspec

from pagedllm import LLM, SamplingParams
from pagedllm.engine.protocol import CoreMessage, OutputsMsg
from pagedllm.entrypoints.openai.dashboard import _gauges

llm = LLM()
core = llm.engine.core
print("blocks", core.kv_cache_manager.kv_stats().num_blocks)
times, enc, maps = [], [], []
encoder = msgspec.msgpack.Encoder()


def listener(*_):
    t = time.perf_counter(); m = core.kv_map(); t1 = time.perf_counter(); b = encoder.encode(m); t2 = time.perf_counter()
    times.append(t1 - t); enc.append((t2 - t1, len(b))); maps.append(m)


core.step_listeners.append(listener)
prompts = [{"prompt_token_ids": list(range(100 + i, 300 + i))} for i in range(32)]
t = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
wall = time.perf_counter() - t
core.step_listeners.clear()
print("steps", len(times), "wall per step ms", 1000 * wall / len(times))
times.sort(); print("kv_map ms median/max", 1000 * times[len(times)//2], 1000 * times[-1])
e = sorted(enc); print("encode ms median", 1000 * e[len(e)//2][0], "bytes", e[len(e)//2][1])

# The API server, per map: the step's OutputsMsg carrying it arrives (decode), then one event per viewer.
busiest = max(maps, key=lambda m: len(m.requests))
stats = msgspec.structs.replace(core.stats(), kv_map=busiest)
frame = encoder.encode(OutputsMsg([], stats, 0.0))
plain = encoder.encode(OutputsMsg([], msgspec.structs.replace(stats, kv_map=None), 0.0))
decoder, json_encoder = msgspec.msgpack.Decoder(CoreMessage), msgspec.json.Encoder()


def per_call_us(fn, n=2000):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - start) / n


def event():
    body = {"time": time.time(), "replicas": [{"replica": "0", "map": busiest, "stats": _gauges(stats)}],
            "stats": _gauges(stats)}
    return b"data: " + json_encoder.encode(body) + b"\n\n"


print(f"server: decode the core's message {per_call_us(lambda: decoder.decode(frame)):.0f} us "
      f"({len(frame)} bytes; {per_call_us(lambda: decoder.decode(plain)):.0f} us without a map), "
      f"encode the event {per_call_us(event):.0f} us ({len(event())} bytes, {len(busiest.requests)} requests)")
