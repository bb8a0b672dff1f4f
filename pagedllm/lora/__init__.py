"""Multi-LoRA serving: PEFT adapters read from disk (peft.py), held in fixed slots of the patched linears
(layers.py), chosen per step by the worker's manager (manager.py). ``request.py`` is torch-free (core/ reads it).

Where the delta runs: each patched linear computes ``y = x W^T`` as before, then, for each adapter present
in the step, ``y[rows] += (x[rows] A^T) B^T`` over that adapter's rows (the runner sorts a step's requests by
adapter, so each adapter's rows are one contiguous range: one GEMM pair per adapter, none for base rows).
"""
