"""Multi-LoRA serving: PEFT adapters read from disk (peft.py), held in fixed slots of the patched linears
(layers.py), chosen per step by the worker's manager (manager.py). ``request.py`` is torch-free (core/ reads it).

Where the delta runs: each patched linear computes ``y = x W^T`` as before, then adds the adapted rows'
``(x A^T) B^T`` as one masked shrink/expand GEMM pair over every slot (layers.py); the runner sorts a step's
requests base first, then by slot, so base rows cost nothing when they come first.
"""
