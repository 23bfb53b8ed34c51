"""The kernels API: int8 quantisation and the fused frozen-int8 + LoRA linear.

Every op has a plain-PyTorch reference (the CPU path and the test oracle) and a Triton kernel
behind the same name. Which one runs is decided per call:

  STEP_KERNELS=auto       (default) CUDA tensors run Triton; CPU tensors run the reference,
                          except under TRITON_INTERPRET=1, where they run Triton's interpreter.
  STEP_KERNELS=reference  always the reference (for A/B comparisons and debugging).
  STEP_KERNELS=triton     always Triton (a CPU tensor then needs TRITON_INTERPRET=1).

TRITON_INTERPRET must be in the environment before this package is imported: Triton reads it
when the kernels are decorated.
"""
import os

import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:  # a CPU laptop without triton still runs everything through the reference
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("STEP_KERNELS", "auto")
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"STEP_KERNELS={mode!r} is not one of auto, reference, triton")
    if mode == "reference" or not HAS_TRITON:
        return False
    if mode == "triton":
        return True
    return t.is_cuda or INTERPRET


from kernels.quant import quantize_int8, dequantize_int8  # noqa: E402
from kernels.frozen_lora import frozen_lora_linear  # noqa: E402

__all__ = ["quantize_int8", "dequantize_int8", "frozen_lora_linear", "use_triton", "HAS_TRITON",
           "INTERPRET"]
