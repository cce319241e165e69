"""Kernel test setup: run Triton kernels in the CPU interpreter.

TRITON_INTERPRET must be in the environment before triton is imported
(``@triton.jit`` decides at decoration time), so it is set here, at collection,
before any test module imports the Triton backend. On a CUDA machine the GPU
tests (marked ``gpu``) run compiled kernels in a separate session
(bench/gpu_check.sh) with TRITON_INTERPRET unset.

If something imported triton earlier in the session (torch._dynamo does), the
interpreter cannot be switched on any more; available_backends() then leaves
triton out and its tests skip instead of failing. Setting TRITON_INTERPRET=1
in the environment (or a root conftest) avoids that.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
