"""Symmetric per-output-row int8 quantisation: w[n, :] ~= q[n, :] * scale[n], |q| <= 127.

quantize_int8 runs once per stage boundary, so its kernel aims at clarity and exact agreement with
the reference. dequantize_int8 is also the first half of the hybrid frozen-LoRA path
(kernels/frozen_lora.py), which calls it twice per layer and step, so that kernel is a plain
bandwidth-bound elementwise pass.
"""
import torch

import kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton wheel (macOS, Windows): keep the module importable for the reference
    from types import SimpleNamespace
    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = SimpleNamespace(constexpr=None)


def check_finite_scale(scale: torch.Tensor, shape):
    """A NaN or inf in a row makes its scale non-finite (both paths see to that): such a row cannot
    be stored, and rounding it anyway would destroy it silently."""
    bad = ~torch.isfinite(scale)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"quantize_int8: {len(rows)} row(s) of the {shape[0]}x{shape[1]} weight hold NaN or inf "
                         f"(first: row {rows[0]}); the weights diverged or were loaded damaged")


def quantize_int8_reference(w: torch.Tensor, stochastic=False, generator=None):
    assert w.ndim == 2, f"quantize_int8 wants a 2-D weight [N, K], got shape {tuple(w.shape)}"
    w = w.float()
    absmax = w.abs().amax(dim=1)                       # NaN propagates, inf stays inf
    check_finite_scale(absmax, w.shape)
    # an all-zero row gets scale 1 so that dequantising it still gives exact zeros, never NaN
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    x = w / scale[:, None]
    if stochastic:   # floor(x + u), u ~ U[0, 1): E[q] = x, so small updates survive on average
        x = torch.floor(x + torch.rand(x.shape, generator=generator).to(x.device))
    q = torch.round(x).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_reference(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    return (q.float() * scale.float()[:, None]).to(dtype)


@triton.jit
def _round_half_even(x):
    # torch.round sends halves to the even neighbour; floor(x + 0.5) would not, and libdevice's rint
    # is unavailable in the interpreter. All steps are exact for |x| < 2**22.
    f = tl.floor(x)
    frac = x - f
    f_is_odd = (f - 2.0 * tl.floor(0.5 * f)) == 1.0
    round_up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(round_up, f + 1.0, f)


@triton.jit
def _quantize_kernel(w_ptr, q_ptr, scale_ptr, N, K, stride_wn, stride_wk,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program owns BLOCK_N whole rows: pass 1 finds each row's absmax, pass 2 writes q
    # (the second read of the rows mostly hits L2)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    absmax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        w = tl.load(w_rows + cols[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        # max() drops NaN on GPUs: send it to inf, so that a bad row's scale is inf, never finite
        absmax = tl.maximum(absmax, tl.max(tl.where(w == w, tl.abs(w), float("inf")), axis=1))
    # div_rn: Triton's `/` is an approximate division on GPUs, and q must match torch bit for bit
    scale = tl.where(absmax > 0, tl.div_rn(absmax, 127.0), 1.0)               # [BLOCK_N]
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        w = tl.load(w_rows + cols[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        q = _round_half_even(tl.div_rn(w, scale[:, None]))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q.to(tl.int8), mask=mask)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr + rows, mask=rows < N, other=1.0)
    w = q.to(tl.float32) * scale[:, None]               # fp32 product, rounded once, like the reference
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask)


def _empty(shape, dtype, device):
    # every element of a kernel's output must be written by the kernel; tests swap this for a
    # poison fill (NaN, or -128 for int8, which quantisation never produces) to check that
    return torch.empty(shape, dtype=dtype, device=device)


def quantize_int8_triton(w: torch.Tensor):
    assert w.ndim == 2, f"quantize_int8 wants a 2-D weight [N, K], got shape {tuple(w.shape)}"
    n, k = w.shape
    q = _empty((n, k), torch.int8, w.device)
    scale = _empty((n,), torch.float32, w.device)
    block_n = 8
    _quantize_kernel[(triton.cdiv(n, block_n),)](w, q, scale, n, k, w.stride(0), w.stride(1),
                                                  BLOCK_N=block_n, BLOCK_K=512)
    check_finite_scale(scale, w.shape)
    return q, scale


def dequantize_int8_triton(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, out=None):
    """`out` lets the hybrid frozen-LoRA path dequantise into a reused scratch buffer."""
    assert q.dtype == torch.int8 and q.ndim == 2 and scale.shape == (q.shape[0],)
    q, scale = q.contiguous(), scale.float().contiguous()
    n, k = q.shape
    if out is None:
        out = _empty((n, k), dtype, q.device)
    assert out.shape == (n, k) and out.dtype == dtype and out.is_contiguous()
    block_n, block_k = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](q, scale, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def quantize_int8(w: torch.Tensor, stochastic=False, generator=None):
    """w [N, K] float -> (q int8 [N, K], scale float32 [N]); q * scale is within half a step of w
    (round to nearest), or within one step and unbiased (stochastic: the noise is drawn on the CPU
    from `generator`, so it is the same on every device; it runs in PyTorch, once per merge).
    A row holding NaN or inf is a ValueError."""
    if kernels.use_triton(w) and not stochastic:
        return quantize_int8_triton(w)
    return quantize_int8_reference(w, stochastic, generator)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    """(q int8 [N, K], scale [N]) -> w [N, K] in `dtype`."""
    if kernels.use_triton(q):
        return dequantize_int8_triton(q, scale, dtype)
    return dequantize_int8_reference(q, scale, dtype)
