"""Where the frozen linear runs: the plain-PyTorch math of frozen_linear.py, or the Triton kernels
of frozen_lora.py. Decided per call:

  STEP_KERNELS=auto       (default) CUDA tensors run Triton; CPU tensors run the reference,
                          except under TRITON_INTERPRET=1, where they run Triton's interpreter.
  STEP_KERNELS=reference  always the reference (for A/B comparisons and debugging).
  STEP_KERNELS=triton     always Triton (a CPU tensor then needs TRITON_INTERPRET=1).

This package is not a top-level `kernels/`: Hugging Face's package of that name (a dependency of
transformers) would be shadowed by it wherever the repository is on the path.
"""
import os

import torch

from stepgpt.kernels.frozen_lora import HAS_TRITON, INTERPRET, PATHS, backward, forward, triton_path

__all__ = ["HAS_TRITON", "INTERPRET", "PATHS", "backward", "choose_path", "compute_dtype", "forward",
           "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("STEP_KERNELS", "auto")
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"STEP_KERNELS={mode!r} is not one of auto, reference, triton")
    if mode == "reference" or not HAS_TRITON:
        return False
    return mode == "triton" or t.is_cuda or INTERPRET


def compute_dtype(x):
    """The dtype a frozen linear computes in: autocast's, where it is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def choose_path(x, q, lora_a):
    """"reference" or a Triton path (PATHS) for x [..., K] through the frozen weight q [N, K]."""
    assert x.shape[-1] == q.shape[1], f"x has K={x.shape[-1]} but the weight has K={q.shape[1]}"
    # a bf16 store is a plain GEMM, which cuBLAS does best; without adapters (rank 0) there is
    # nothing to fuse; fp32 activations where torch forbids TF32 would make the kernels' dots plain
    # FMA, far slower than cuBLAS in fp32: all three take the reference path
    fp32_ok = x.dtype != torch.float32 or INTERPRET or torch.backends.cuda.matmul.allow_tf32
    if not (use_triton(x) and q.dtype == torch.int8 and lora_a.shape[0] > 0 and fp32_ok):
        return "reference"
    k = x.shape[-1]
    return triton_path(x.numel() // k, q.shape[0], k, lora_a.shape[0])
