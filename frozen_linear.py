"""STEP's frozen linear, y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ: W frozen (int8 q with one fp32 scale per output
row, or bf16), the LoRA adapter A [r, K], B [N, r] trained, s = alpha / r. Its math in plain
PyTorch, forward and backward, and the autograd around it. The backward never forms dW, so autograd
keeps x, S = x·Aᵀ and the int8 weight: nothing weight-sized in float. On CUDA the same op runs the
fused Triton kernels of stepgpt/kernels (`path` names them), which never write the float weight.
"""
from functools import partial
from typing import Optional

import torch
from torch import Tensor

from stepgpt import kernels


def weight(q, scale, dt):
    # the one weight-sized temporary, never saved: q in the compute dtype times its row scale
    w = q.to(dt)
    return w.mul_(scale.to(dt)[:, None]) if scale is not None else w


def forward(x, q, scale, a, b, s):
    """x [M, K] -> y [M, N] and S = x·Aᵀ [M, r], which the backward needs."""
    dt = x.dtype
    xa = x @ a.to(dt).t()                                                     # [M, r]
    y = torch.mm(x, weight(q, scale, dt).t()).addmm_(xa, b.to(dt).t(), alpha=s)   # [M, N]
    return y, xa


def backward(dy, x, q, scale, a, b, xa, s, need_dx):
    """dX = dY·W + s·(dY·B)·A,  dA = s·(dY·B)ᵀ·x,  dB = s·dYᵀ·S  (dX only when x needs it)."""
    dt = x.dtype
    dyb = dy @ b.to(dt)                                                       # [M, r]
    dx = torch.addmm(dyb @ a.to(dt), dy, weight(q, scale, dt), beta=s) if need_dx else None   # [M, K]
    da = (dyb.t() @ x).mul_(s).to(a.dtype)                                    # [r, K]
    db = (xa.t() @ dy).mul_(s).t().contiguous().to(b.dtype)   # [N, r]; Sᵀ·dY runs 4-7x faster on CPUs
    return dx, da, db


# custom ops, not an autograd.Function: torch.compile keeps them in its graph (it traces the fakes)
@torch.library.custom_op("step::frozen_lora_linear", mutates_args=())
def _op(x: Tensor, q: Tensor, scale: Optional[Tensor], a: Tensor, b: Tensor, s: float,
        path: str) -> tuple[Tensor, Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        return (forward if path == "reference" else partial(kernels.forward, path))(x, q, scale, a, b, s)


@torch.library.custom_op("step::frozen_lora_linear_backward", mutates_args=())
def _op_backward(dy: Tensor, x: Tensor, q: Tensor, scale: Optional[Tensor], a: Tensor, b: Tensor,
                 xa: Tensor, s: float, path: str, need_dx: bool) -> tuple[Tensor, Tensor, Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        fn = backward if path == "reference" else partial(kernels.backward, path)
        dx, da, db = fn(dy.to(x.dtype), x, q, scale, a, b, xa, s, need_dx)
    return (dx if need_dx else x.new_empty(0)), da, db   # an op cannot return None


_op.register_fake(lambda x, q, scale, a, b, s, path: (x.new_empty(x.shape[0], q.shape[0]),
                                                       x.new_empty(x.shape[0], a.shape[0])))
_op_backward.register_fake(lambda dy, x, q, scale, a, b, xa, s, path, need_dx: (
    torch.empty_like(x) if need_dx else x.new_empty(0), torch.empty_like(a), torch.empty_like(b)))


def _save(ctx, inputs, output):
    x, q, scale, a, b, s, path = inputs
    ctx.save_for_backward(x, q, scale, a, b, output[1])
    ctx.s, ctx.path = s, path


def _grads(ctx, dy, _dxa):
    need_dx = ctx.needs_input_grad[0]
    dx, da, db = _op_backward(dy, *ctx.saved_tensors, ctx.s, ctx.path, need_dx)
    return (dx if need_dx else None), None, None, da, db, None, None


_op.register_autograd(_grads, setup_context=_save)


def frozen_lora_linear(x, q, scale, a, b, s, path=None):
    """x [..., K] -> y [..., N]; gradients reach x, A and B. `path` forces one (tests, benchmarks)."""
    x = x.to(kernels.compute_dtype(x))        # autocast does not reach inside a custom op
    path = path or kernels.choose_path(x, q, scale, a, b, s, (forward, backward))
    y, _ = _op(x.reshape(-1, x.shape[-1]), q, scale, a, b, float(s), path)
    return y.reshape(*x.shape[:-1], q.shape[0])
