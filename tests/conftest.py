"""Environment defaults for the whole suite. pytest imports this file before any test module, which
matters because Triton reads TRITON_INTERPRET when the kernels are defined, at `import kernels`."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU tensors
# model and training tests use the plain-PyTorch kernels; tests/test_kernels.py asks for Triton itself
os.environ.setdefault("STEP_KERNELS", "reference")
