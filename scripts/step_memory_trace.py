"""In-process: the engine core's memory through a burst of 128-token prompts, per step and (--hooks) per module of
layers 0, 1 and 15, with glibc's heap figures (mallinfo2); VmHWM is reset before each step. docs/benchmarks.md "Session 13".

    PYTHONPATH=$PWD .venv/bin/python scripts/step_memory_trace.py [--hooks] [--mmap-threshold MiB] [--trim-tokens N]
        [--mlp-rows N] [--mbt N]

--mmap-threshold sets glibc's as the engine core process does (worker/host_memory.py); the in-process LLM does not.
"""
import ctypes, os, random, sys, time, argparse
p = argparse.ArgumentParser()
p.add_argument("--model", default=os.path.expanduser("~/.cache/pagedllm/random-gguf/llama-3.2-1b-Q4_0.gguf"))
p.add_argument("--hooks", action="store_true")
p.add_argument("--burst", type=int, default=16)
p.add_argument("--mbt", type=int, default=None)
p.add_argument("--mmap-threshold", type=int, default=None, help="MiB")
p.add_argument("--trim-tokens", type=int, default=None)
p.add_argument("--mlp-rows", type=int, default=None, help="the MLP's row slices at the 1B shape (0: none)")
a = p.parse_args()

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena","ordblks","smblks","hblks","hblkhd","usmblks","fsmblks","uordblks","fordblks","keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def st():
    f = dict(l.split(":",1) for l in open("/proc/self/status"))
    m = libc.mallinfo2()
    return dict(rss=int(f["VmRSS"].split()[0])>>10, hwm=int(f["VmHWM"].split()[0])>>10, anon=int(f["RssAnon"].split()[0])>>10,
                heap=m.arena>>20, heap_used=m.uordblks>>20, heap_free=m.fordblks>>20, mmapped=m.hblkhd>>20, nmmap=m.hblks)
def reset_hwm():
    open("/proc/self/clear_refs","w").write("5")
def show(tag, s=None):
    s = s or st(); print(f"{tag:40s} " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)

if a.mmap_threshold is not None:
    print("mallopt", libc.mallopt(-3, a.mmap_threshold << 20))
if a.mlp_rows is not None:  # 0: one call, whatever the size
    from pagedllm.model import llama
    llama.MLP_WORKSPACE_BYTES = a.mlp_rows * 2 * 8192 * 4 if a.mlp_rows > 0 else 1 << 40
from pagedllm import LLM, SamplingParams
kw = dict(num_threads=2, kv_cache_memory=272 << 20)
if a.mbt: kw["max_num_batched_tokens"] = a.mbt
llm = LLM(a.model, **kw)
show("loaded")
core = llm.engine.core
ex = core.executor
orig = ex.execute_model
log = []
def execute(sched):
    n = sum(sched.num_scheduled_tokens.values())
    reset_hwm(); before = st(); t = time.perf_counter()
    out = orig(sched)
    if a.trim_tokens is not None and n >= a.trim_tokens:
        libc.malloc_trim(0)
    after = st(); log.append((n, len(sched.num_scheduled_tokens), before, after, time.perf_counter() - t))
    return out
ex.execute_model = execute
rng = random.Random(0)
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
llm.generate([[rng.randrange(100, 40000) for _ in range(128)]], params, use_tqdm=False)
show("after 1 request")
if a.hooks:
    model = ex.runner.model
    trace = []
    def post(name):
        def hook(mod, inp, out):
            if isinstance(inp, tuple) and inp and hasattr(inp[0], "shape") and inp[0].shape[0] >= 512:
                trace.append((name, st()))
        return hook
    for name, mod in model.named_modules():
        if name.count(".") >= 3 and (name.startswith("model.layers.0.") or name.startswith("model.layers.1.") or name.startswith("model.layers.15.")):
            mod.register_forward_hook(post(name))
    for name in ("model.embed_tokens", "model.norm", "lm_head"):
        model.get_submodule(name).register_forward_hook(post(name))
log.clear()
t = time.perf_counter()
llm.generate([[rng.randrange(100, 40000) for _ in range(128)] for _ in range(a.burst)], params, use_tqdm=False)
print(f"burst {time.perf_counter() - t:.1f} s")
for n, r, b, af, dt in log[:3]:
    show(f"step {n} tokens {r} reqs {dt*1e3:.0f} ms: before", b); show("   after (hwm = step peak)", af)
print("max step peak", max(af["hwm"] for *_, af, _ in log))
show("after burst")
libc.malloc_stats()
libc.malloc_trim(0)
show("after malloc_trim(0)")
if a.hooks:
    for name, s in trace:
        show("  " + name, s)
