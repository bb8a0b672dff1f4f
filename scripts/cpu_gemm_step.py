"""One decode step of the default model with the compiled GEMM vs the MKL packed path, side by
side in one process (two copies of the model, steps interleaved, so machine noise hits both):

    PYTHONPATH=$PWD .venv/bin/python scripts/cpu_gemm_step.py [--batch 14] [--context 700] [--threads 2]

"on" is the model as load_model returns it with the compiled GEMM on; "off" is a second copy
loaded with PAGEDLLM_DISABLE_CPU_GEMM=1 (MKL packed copies, as before). A step is the model's
forward for ``batch`` sequences of ``context`` cached tokens plus one new token each, then the
logits of those rows (no sampling, no scheduler), as in scripts/decode_step_layouts.py.
"""

import argparse
import os
import statistics
import time

import torch

from pagedllm.model import load_model
from pagedllm.model.layers import cpu_gemm
from scripts.decode_step_layouts import decode_inputs, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=14)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    on = load_model(None).model
    os.environ[cpu_gemm.DISABLE_ENV] = "1"
    off = load_model(None).model
    del os.environ[cpu_gemm.DISABLE_ENV]
    assert on.lm_head.gemm_weight is not None and off.lm_head.gemm_weight is None
    inputs = decode_inputs(on, args.batch, args.context)
    # Only float32 summation order differs; over 30 layers on random K/V it moves logits by ~1e-2.
    torch.testing.assert_close(step(on, *inputs), step(off, *inputs), atol=5e-2, rtol=1e-3)
    times = {"on": [], "off": []}
    for r in range(args.rounds):
        order = [("on", on), ("off", off)]
        for name, model in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            step(model, *inputs)
            times[name].append((time.perf_counter() - start) * 1e3)
    a, b = times["on"], times["off"]
    print(f"batch {args.batch} x context {args.context}, {args.threads} threads, ms per step: "
          f"on min {min(a):.1f} median {statistics.median(a):.1f}; off min {min(b):.1f} median "
          f"{statistics.median(b):.1f}; on/off {min(a) / min(b):.2f} (min) {statistics.median(a) / statistics.median(b):.2f} (median)")


if __name__ == "__main__":
    main()
