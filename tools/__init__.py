"""The harness: qualify (main job), replay, goldens, task traces, benchmarks, mutants.

On a machine without CUDA the fast path's Triton kernels can only run in the interpreter, so the tools turn it
on (before anything imports triton) unless the caller set TRITON_INTERPRET explicitly.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
