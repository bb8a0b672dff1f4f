"""The engine core's KV block map on a busy engine: build and encode time per step (the dashboard's core-side cost),
the default model, 32 requests of 200 prompt tokens decoding 64 each; a step listener times `core.kv_map()`.

    PYTHONPATH=$PWD .venv/bin/python scripts/kv_map_step_cost.py
"""
import time, msgspec
from pagedllm import LLM, SamplingParams
llm = LLM()
core = llm.engine.core
print("blocks", core.kv_cache_manager.kv_stats().num_blocks)
times, enc = [], []
encoder = msgspec.msgpack.Encoder()
def listener(*_):
    t = time.perf_counter(); m = core.kv_map(); t1 = time.perf_counter(); b = encoder.encode(m); t2 = time.perf_counter()
    times.append(t1 - t); enc.append((t2 - t1, len(b)))
core.step_listeners.append(listener)
prompts = [{"prompt_token_ids": list(range(100 + i, 300 + i))} for i in range(32)]
t = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
wall = time.perf_counter() - t
core.step_listeners.clear()
print("steps", len(times), "wall per step ms", 1000 * wall / len(times))
times.sort(); print("kv_map ms median/max", 1000 * times[len(times)//2], 1000 * times[-1])
e = sorted(enc); print("encode ms median", 1000 * e[len(e)//2][0], "bytes", e[len(e)//2][1])
