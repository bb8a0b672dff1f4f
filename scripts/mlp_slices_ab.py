"""One layer's MLP of the 1B Q4_0 at 2048 tokens: whole vs 512-row slices (alternating), and malloc settings.

    PYTHONPATH=$PWD .venv/bin/python scripts/mlp_slices_ab.py [pairs]
"""
import ctypes, os, resource, sys, time
import torch
from pagedllm.model import llama
from pagedllm.model.loader import load_model
torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6")
m = load_model(os.path.expanduser("~/.cache/pagedllm/random-gguf/llama-3.2-1b-Q4_0.gguf")).model
mlp = m.model.layers[0].mlp
x = torch.randn(2048, 2048)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime, r.ru_minflt
res = {}
ref = None
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for mode in ("whole/default", "sliced/fixed"):
        if mode == "whole/default":
            llama.MLP_WORKSPACE_BYTES = 1 << 40; libc.mallopt(-3, 32 << 20); libc.mallopt(-1, 64 << 20)
        else:
            llama.MLP_WORKSPACE_BYTES = 32 << 20; libc.mallopt(-3, 4 << 20); libc.mallopt(-1, 8 << 20)
        c0, f0 = cpu(); t = time.perf_counter()
        with torch.inference_mode():
            y = mlp(x)
        dt = time.perf_counter() - t; c1, f1 = cpu()
        res.setdefault(mode, []).append((dt, c1 - c0, f1 - f0))
        if ref is None: ref = y
        else: print(mode, "equal to whole:", torch.equal(y, ref), float((y - ref).abs().max()), flush=True)
        print(mode, f"wall {dt:.2f} s cpu {c1-c0:.2f} s minor faults {f1-f0}", flush=True)
for mode, rows in res.items():
    print(mode, "median wall", sorted(r[0] for r in rows)[len(rows)//2], "median cpu", sorted(r[1] for r in rows)[len(rows)//2])
