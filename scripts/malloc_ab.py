"""Decode steps under glibc's risen default (mmap 32 MiB, trim 64 MiB) vs host_memory's (4 / 8 MiB), alternating in
one process: CPU seconds and minor page faults per decode step, and per 256-token prefill step.

    PYTHONPATH=$PWD .venv/bin/python scripts/malloc_ab.py [model] [num_requests]
"""
import ctypes, os, random, resource, sys, time
libc = ctypes.CDLL("libc.so.6")
from pagedllm import LLM, SamplingParams
model = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/pagedllm/random-gguf/llama-3.2-1b-Q4_0.gguf")
nreq = int(sys.argv[2]) if len(sys.argv) > 2 else 32
llm = LLM(model, num_threads=2, kv_cache_memory=272 << 20)
ex = llm.engine.core.executor
orig = ex.execute_model
cur = []
def execute(sched):
    n = sum(sched.num_scheduled_tokens.values())
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    out = orig(sched)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cur.append((n, len(sched.num_scheduled_tokens), r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                r1.ru_minflt - r0.ru_minflt, time.perf_counter() - t))
    return out
ex.execute_model = execute
rng = random.Random(0)
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
res = {}
for rnd in range(3):
    for mode in ("glibc risen default", "host_memory"):
        if mode == "host_memory":
            libc.mallopt(-3, 4 << 20); libc.mallopt(-1, 8 << 20)
        else:
            libc.mallopt(-3, 32 << 20); libc.mallopt(-1, 64 << 20)
        cur.clear()
        llm.generate([[rng.randrange(100, 40000) for _ in range(8)] for _ in range(nreq)], params, use_tqdm=False)
        dec = [c for c in cur if c[0] == c[1] and c[1] == nreq]
        pre = [c for c in cur if c[0] > c[1]]
        d = res.setdefault(mode, {"dec_cpu": [], "dec_flt": [], "pre_cpu": [], "pre_flt": []})
        d["dec_cpu"] += [c[2] for c in dec]; d["dec_flt"] += [c[3] for c in dec]
        d["pre_cpu"] += [c[2] for c in pre]; d["pre_flt"] += [c[3] for c in pre]
        print(rnd, mode, f"decode steps {len(dec)}: cpu/step {sum(c[2] for c in dec)/len(dec)*1e3:.1f} ms, faults/step {sum(c[3] for c in dec)/len(dec):.0f}; "
              f"prefill {[(c[0], round(c[2], 2), c[3]) for c in pre]}", flush=True)
med = lambda v: sorted(v)[len(v) // 2]
for mode, d in res.items():
    print(mode, f"median decode cpu/step {med(d['dec_cpu'])*1e3:.1f} ms faults {med(d['dec_flt'])}; prefill cpu {med(d['pre_cpu']):.2f} s faults {med(d['pre_flt'])}")
