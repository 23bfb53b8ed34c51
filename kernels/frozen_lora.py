"""y = x @ (q * scale)^T + s * (x @ A^T) @ B^T  with q frozen int8, differentiable in x, A, B.

The reference (the CPU path and the tests' oracle) dequantises the weight for each matmul into one
transient temporary (q cast to the compute dtype, times the row scale), never saved for backward:
on a CPU that is cheaper than scaling the output columns, and the saved state stays int8.

The Triton path follows shared/research/kernel_anchors.md §9. Per layer and step:

  F1 _lora_down_kernel  S   = x·Aᵀ                               [M, r]  memory-bound, saved for B1
  F2 _fwd_kernel        y   = (x·Qᵀ)·diag(scale) + s·S·Bᵀ        [M, N]  main GEMM
  B1 _lora_bwd_kernel   dYB = dY·B,  dB = s·dYᵀ·S,  dA = s·dYBᵀ·x        one pass over dY and over x
  B3 _dx_kernel         dX  = (dY·diag(scale))·Q + s·dYB·A       [M, K]  main GEMM

Q is dequantised tile by tile in registers inside the K-loop (q·scale rounded once to the compute
dtype, the value the hybrid path's dequantised weight holds) and is never written to memory. All
accumulation is fp32; every kernel is compiled for sm_90 and checked for spills, shared memory and
serialised wgmma pipelines by bench/compile_kernels.py, on every CI run. choose_path() picks per
shape between that fused path and a hybrid one (dequantise into a reused scratch buffer, cuBLAS for
the two main GEMMs, F1/B1 for the low-rank side).
"""
import os
from typing import Optional

import torch

import kernels
from kernels.quant import dequantize_int8_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton wheel (macOS, Windows): keep the module importable for the reference
    from types import SimpleNamespace
    triton = SimpleNamespace(jit=lambda fn: fn, autotune=lambda *args, **kw: (lambda fn: fn),
                             Config=lambda *args, **kw: None)
    tl = SimpleNamespace(constexpr=None)


def _weight(q, scale, dt):
    # the one weight-sized temporary: q cast to the compute dtype, the row scale applied in place
    # (N·K multiplies, against M·N for scaling the output: fewer whenever M > K)
    w = q.to(dt)
    return w.mul_(scale.to(dt)[:, None]) if scale is not None else w


def _reference_forward(x, q, scale, lora_a, lora_b, lora_scale):
    # x [M, K] in the compute dtype; q [N, K] int8 with scale [N] fp32, or a float weight with
    # scale None (the bf16 store); A [r, K]; B [N, r]  ->  y [M, N], S = x·Aᵀ [M, r]
    dt = x.dtype
    s = x @ lora_a.to(dt).t()                                   # [M, r]
    y = torch.addmm(s @ lora_b.to(dt).t(), x, _weight(q, scale, dt).t(), beta=lora_scale)   # [M, N]
    return y, s


def _reference_backward(dy, x, q, scale, lora_a, lora_b, s, lora_scale, need_dx):
    dt = x.dtype
    a, b = lora_a.to(dt), lora_b.to(dt)
    dyb = dy @ b                                                # [M, r]
    dx = torch.addmm(dyb @ a, dy, _weight(q, scale, dt), beta=lora_scale) if need_dx else None   # [M, K]
    da = (dyb.t() @ x).mul_(lora_scale).to(lora_a.dtype)       # [r, K]
    db = (dy.t() @ s).mul_(lora_scale).to(lora_b.dtype)        # [N, r]
    return dx, da, db


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
# Conventions: tensors are row-major with explicit strides; the LoRA rank r lives in one tile of
# R_PAD = max(16, next_pow2(r)) columns (tl.dot needs >= 16) and is masked to r. Row offsets that
# multiply an activation stride are int64, since M·K passes 2**31 at long contexts.

# Under the interpreter (or without CUDA) the autotuner cannot benchmark, so only the first config
# of each list is used: keep it small enough for quick interpreted tests and valid on any GPU.
_ONE_CONFIG = kernels.INTERPRET or not torch.cuda.is_available()


def _configs(names, rows):
    # each row: the tile sizes named in `names`, then num_stages, num_warps
    return [triton.Config(dict(zip(names, row[:-2])), num_stages=row[-2], num_warps=row[-1]) for row in rows]


def _tuned(configs):
    return configs[:1] if _ONE_CONFIG else configs


# Autotune keys name (M, N, K, R) and the mode flags; Triton adds every tensor argument's dtype
# to the key itself. Configs that do not fit (shared memory, registers) are skipped by the tuner.
# main GEMMs (F2, B3): the Triton-tutorial / LoRAFusion Hopper set plus a small-M tile (§9.3)
_MAIN_ROWS = [
    (64, 64, 64, 8, 3, 4),
    (128, 128, 64, 8, 4, 4),
    (128, 256, 64, 8, 3, 8),
    (256, 128, 64, 8, 3, 8),
    (128, 128, 128, 8, 3, 8),
    (64, 256, 64, 8, 4, 8),
    (256, 64, 64, 8, 4, 8),
]
# F2: output tile BLOCK_M x BLOCK_N, K-step BLOCK_K. B3: output tile BLOCK_M x BLOCK_K, N-step BLOCK_N.
_FWD_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"), _MAIN_ROWS)
_DX_CONFIGS = _configs(("BLOCK_M", "BLOCK_K", "BLOCK_N", "GROUP_M"), _MAIN_ROWS)
# memory-bound side kernels: large row blocks keep r-wide partial products in registers
_DOWN_CONFIGS = _configs(("BLOCK_M", "BLOCK_K"), [
    (64, 64, 3, 4), (128, 128, 4, 8), (64, 128, 4, 4), (128, 64, 4, 4), (32, 128, 4, 4)])
_BWD_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_K"), [
    (64, 64, 64, 3, 4), (128, 128, 64, 3, 8), (64, 128, 128, 4, 8), (128, 64, 64, 4, 8)])


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M row tiles sweep the column tiles together, so each weight tile is re-read from L2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_m
    pid_n = (pid % tiles_per_group) // group_m
    return pid_m, pid_n


@triton.autotune(configs=_tuned(_DOWN_CONFIGS), key=["M", "K", "R"])
@triton.jit
def _lora_down_kernel(x_ptr, a_ptr, s_ptr, M, K, R, stride_xm, stride_xk, stride_ar, stride_ak,
                      PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # F1: S[rows, :] = x[rows, :] · Aᵀ for one block of rows
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, r_ok = offs_m < M, offs_r < R
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk   # [BM, BK]
    at_ptrs = a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak               # [BK, R_PAD]
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(at_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(x, at, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        at_ptrs += BLOCK_K * stride_ak
    # stored in the compute dtype, as the reference keeps x @ A^T
    s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * R + offs_r[None, :]
    tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.autotune(configs=_tuned(_FWD_CONFIGS), key=["M", "N", "K", "R"])
@triton.jit
def _fwd_kernel(x_ptr, q_ptr, scale_ptr, b_ptr, s_ptr, y_ptr, lora_scale, M, N, K, R,
                stride_xm, stride_xk, stride_bn, stride_br,
                PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    # F2: one BLOCK_M x BLOCK_N tile of y
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    tile_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tile_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap the ragged edge instead of masking it: loads stay unmasked in M and N, and the wrapped
    # duplicates are dropped by the masked stores (Triton matmul tutorial)
    offs_m = tile_m % M
    offs_n = tile_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    dt = x_ptr.dtype.element_ty
    # The tile is computed transposed, yᵀ = Q·xᵀ, so that the converted int8 tile is the MMA's
    # left operand, which Hopper's wgmma reads from registers: it never goes back to shared memory.
    # The low-rank term s·B·Sᵀ starts the accumulator, so that from there on only MMAs write it: an
    # epilogue that scales or adds to it after the K-loop makes ptxas serialise the wgmma pipeline
    # (C7515) or hold a second fp32 tile and spill (bench/compile_kernels.py measures both).
    bt = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                 mask=r_ok[None, :], other=0.0)                                                # [BN, R_PAD]
    st = tl.load(s_ptr + offs_m[None, :].to(tl.int64) * R + offs_r[:, None],
                 mask=r_ok[:, None], other=0.0)                                                # [R_PAD, BM]
    bt = (bt.to(tl.float32) * lora_scale).to(dt)
    acc = tl.dot(bt, st, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), input_precision=PRECISION)  # yᵀ
    scale = tl.load(scale_ptr + offs_n)                                                        # [BN] fp32
    q_ptrs = q_ptr + offs_n[:, None] * K + offs_k[None, :]                                     # [BN, BK]
    xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk   # [BK, BM]
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        q = tl.load(q_ptrs, mask=k_ok[None, :], other=0)
        xt = tl.load(xt_ptrs, mask=k_ok[:, None], other=0.0)
        # dequantised in registers with the row scale and rounded once, as the hybrid path's
        # weight is; the dequantised weight never exists in memory
        w = (q.to(tl.float32) * scale[:, None]).to(dt)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        q_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K * stride_xk
    y_ptrs = y_ptr + tile_m[None, :].to(tl.int64) * N + tile_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(tile_n[:, None] < N) & (tile_m[None, :] < M))


@triton.jit
def _accumulate(ptrs, value, mask, DETERMINISTIC: tl.constexpr):
    if DETERMINISTIC:
        # the slice belongs to this program alone: a plain read-modify-write, always in the same order
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)
    else:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")


@triton.autotune(configs=_tuned(_BWD_CONFIGS), key=["M", "N", "K", "R", "DETERMINISTIC"],
                 reset_to_zero=["da_ptr", "db_ptr"])
@triton.jit
def _lora_bwd_kernel(dy_ptr, x_ptr, b_ptr, s_ptr, dyb_ptr, da_ptr, db_ptr, M, N, K, R,
                     stride_dym, stride_dyn, stride_xm, stride_xk, stride_bn, stride_br,
                     DETERMINISTIC: tl.constexpr, PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # B1 + B2: a program owns whole row blocks of dY, so dYB = dY·B is complete in registers after
    # one sweep over N and is multiplied into x at once: dY and x are each read once. dB and dA sum
    # over all rows, across programs: atomically into one fp32 buffer, or (DETERMINISTIC) into this
    # program's own slice [pid] of a partial buffer that the launcher sums in a fixed order.
    pid = tl.program_id(0)
    part = pid if DETERMINISTIC else 0
    db_ptr += part * N * R                                                    # db: [slices, N, R] fp32
    da_ptr += part * R * K                                                    # da: [slices, R, K] fp32
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    for mb in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        if DETERMINISTIC:  # make the previous block's partial-sum stores visible to every thread
            tl.debug_barrier()
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        rows = offs_m[:, None].to(tl.int64)
        s = tl.load(s_ptr + rows * R + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        dyb = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :] * stride_dyn,
                         mask=m_ok[:, None] & n_ok[None, :], other=0.0)                  # [BM, BN]
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                        mask=n_ok[:, None] & r_ok[None, :], other=0.0)                   # [BN, R_PAD]
            dyb = tl.dot(dy, b, dyb, input_precision=PRECISION)
            db = tl.dot(tl.trans(dy), s, input_precision=PRECISION)                      # [BN, R_PAD]
            _accumulate(db_ptr + offs_n[:, None] * R + offs_r[None, :], db,
                        n_ok[:, None] & r_ok[None, :], DETERMINISTIC)
        # rounded to the compute dtype, as in the reference; B3 reads it back for dX's low-rank term
        dyb = dyb.to(dyb_ptr.dtype.element_ty)
        tl.store(dyb_ptr + rows * R + offs_r[None, :], dyb, mask=m_ok[:, None] & r_ok[None, :])
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)                   # [BM, BK]
            da = tl.dot(tl.trans(dyb), x, input_precision=PRECISION)                     # [R_PAD, BK]
            _accumulate(da_ptr + offs_r[:, None] * K + offs_k[None, :], da,
                        r_ok[:, None] & k_ok[None, :], DETERMINISTIC)


@triton.autotune(configs=_tuned(_DX_CONFIGS), key=["M", "N", "K", "R"])
@triton.jit
def _dx_kernel(dy_ptr, q_ptr, scale_ptr, a_ptr, dyb_ptr, dx_ptr, lora_scale, M, N, K, R,
               stride_dym, stride_dyn, stride_ar, stride_ak,
               PRECISION: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_M: tl.constexpr):
    # B3: one BLOCK_M x BLOCK_K tile of dX, reducing over N
    pid_m, pid_k = _grouped_tile(tl.program_id(0), M, K, BLOCK_M, BLOCK_K, GROUP_M)
    tile_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tile_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tile_m % M
    offs_k = tile_k % K
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    dt = dy_ptr.dtype.element_ty
    # transposed again, dXᵀ = Qᵀ·(diag(scale)·dYᵀ), to keep the converted int8 tile on the left
    qt_ptrs = q_ptr + offs_n[None, :] * K + offs_k[:, None]                                      # [BK, BN]
    dyt_ptrs = dy_ptr + offs_m[None, :].to(tl.int64) * stride_dym + offs_n[:, None] * stride_dyn  # [BN, BM]
    # as in F2, the low-rank term s·A·dYBᵀ starts the accumulator and only MMAs write it after
    at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                 mask=r_ok[None, :], other=0.0)                                                  # [BK, R_PAD]
    dybt = tl.load(dyb_ptr + offs_m[None, :].to(tl.int64) * R + offs_r[:, None],
                   mask=r_ok[:, None], other=0.0)                                                # [R_PAD, BM]
    at = (at.to(tl.float32) * lora_scale).to(dt)
    acc = tl.dot(at, dybt, tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32), input_precision=PRECISION)  # dXᵀ
    for n0 in range(0, N, BLOCK_N):
        n_ok = offs_n < N - n0
        qt = tl.load(qt_ptrs, mask=n_ok[None, :], other=0)
        dyt = tl.load(dyt_ptrs, mask=n_ok[:, None], other=0.0)
        scale = tl.load(scale_ptr + n0 + offs_n, mask=n_ok, other=0.0)
        # the scale goes onto the register operand, as in F2: scaling the dY tile instead would pull
        # that shared-memory operand into registers and back, and spill
        wt = (qt.to(tl.float32) * scale[None, :]).to(dt)
        acc = tl.dot(wt, dyt, acc, input_precision=PRECISION)
        qt_ptrs += BLOCK_N * K
        dyt_ptrs += BLOCK_N * stride_dyn

    dx_ptrs = dx_ptr + tile_m[None, :].to(tl.int64) * K + tile_k[:, None]
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(tile_k[:, None] < K) & (tile_m[None, :] < M))


# ----------------------------------------------------------------------------------------------
# Launchers

def _empty(shape, dtype, device):
    # every element of a kernel's output must be written by the kernel; tests swap this for a NaN
    # fill to check that
    return torch.empty(shape, dtype=dtype, device=device)


def _r_pad(r):
    return max(16, triton.next_power_of_2(r))


def _dot_precision(dtype):
    # fp32 activations follow torch's own matmul setting: TF32 only where torch would use it too
    if dtype == torch.float32 and (kernels.INTERPRET or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"  # Triton's default; fp16/bf16 operands ignore it


def _deterministic():
    return os.environ.get("STEP_DETERMINISTIC") == "1" or torch.are_deterministic_algorithms_enabled()


def _lora_down(x, a):
    m, k = x.shape
    r = a.shape[0]
    s = _empty((m, r), x.dtype, x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)  # noqa: E731
    _lora_down_kernel[grid](x, a, s, m, k, r, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                            PRECISION=_dot_precision(x.dtype), R_PAD=_r_pad(r))
    return s


def _fused_forward(x, q, scale, a, b, lora_scale):
    m, k = x.shape
    n, r = q.shape[0], a.shape[0]
    s = _lora_down(x, a)
    y = _empty((m, n), x.dtype, x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _fwd_kernel[grid](x, q, scale, b, s, y, lora_scale, m, n, k, r,
                      x.stride(0), x.stride(1), b.stride(0), b.stride(1),
                      PRECISION=_dot_precision(x.dtype), R_PAD=_r_pad(r))
    return y, s


# The deterministic mode's partial buffers take slices·(N+K)·r·4 bytes: cap them
DETERMINISTIC_PARTIAL_BYTES = 64 << 20


def _lora_backward(dy, x, b, s, deterministic):
    """-> dYB [M, r] (compute dtype), dA [r, K] and dB [N, r] (fp32, not yet times lora_scale)."""
    m, k = x.shape
    n, r = b.shape
    if deterministic:
        sms = torch.cuda.get_device_properties(dy.device).multi_processor_count if dy.is_cuda else 2
        slices = max(1, min(sms, DETERMINISTIC_PARTIAL_BYTES // ((n + k) * r * 4)))
        programs = slices
    else:
        slices, programs = 1, m  # one program per row block, all adding into slice 0
    dyb = _empty((m, r), dy.dtype, dy.device)
    da = torch.zeros((slices, r, k), dtype=torch.float32, device=dy.device)
    db = torch.zeros((slices, n, r), dtype=torch.float32, device=dy.device)
    grid = lambda meta: (min(programs, triton.cdiv(m, meta["BLOCK_M"])),)  # noqa: E731
    _lora_bwd_kernel[grid](dy, x, b, s, dyb, da, db, m, n, k, r,
                           dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                           b.stride(0), b.stride(1),
                           DETERMINISTIC=deterministic, PRECISION=_dot_precision(dy.dtype),
                           R_PAD=_r_pad(r))
    # torch.sum over the slice dimension is a fixed-order reduction (no atomics)
    return dyb, da.sum(0), db.sum(0)


def _fused_dx(dy, q, scale, a, dyb, lora_scale):
    m, n = dy.shape
    r, k = a.shape
    dx = _empty((m, k), dy.dtype, dy.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_K"]),)  # noqa: E731
    _dx_kernel[grid](dy, q, scale, a, dyb, dx, lora_scale, m, n, k, r,
                     dy.stride(0), dy.stride(1), a.stride(0), a.stride(1),
                     PRECISION=_dot_precision(dy.dtype), R_PAD=_r_pad(r))
    return dx


# One flat buffer per (device, dtype) holds the dequantised weight of whichever layer runs now
# (Unsloth's WEIGHT_BUFFERS): transient memory is one layer's weight, never one per layer. Safe
# because every user is stream-ordered: the next dequantise waits for the matmul reading it.
_SCRATCH = {}


def _dequantize_to_scratch(q, scale, dtype):
    key = (q.device, dtype)
    if key not in _SCRATCH or _SCRATCH[key].numel() < q.numel():
        _SCRATCH[key] = _empty((q.numel(),), dtype, q.device)
    w = _SCRATCH[key][: q.numel()].view(q.shape)
    return dequantize_int8_triton(q, scale, dtype, out=w)


# ----------------------------------------------------------------------------------------------
# Which path runs (kernel_anchors.md §9.4). PLACEHOLDER THRESHOLDS from the §8 cost model; they
# need measuring with `python bench/kernels.py` on each GPU and updating here.
#
#   tokens M  \  weight N·K      < HYBRID_MIN_WEIGHT       >= HYBRID_MIN_WEIGHT
#   M <  HYBRID_MIN_TOKENS       fused                     fused
#   M >= HYBRID_MIN_TOKENS       fused                     hybrid
#
# Dequantising to scratch costs ~1.5·(F/BW)/M of the GEMM (F/BW ≈ 165 FLOP/B on an H200: 12% at
# M=2k, 3% at 8k), while public Triton int8 x bf16 main loops reach 0.4-0.8x of cuBLAS; so large
# M goes hybrid unless bench shows the fused kernel >= 0.95x cuBLAS. Small weights stay fused:
# there the extra launches (dequantise, addmm) cost more than the GEMM efficiency gains.
# (A third path that recomputed S = x·Aᵀ inside F2's K-loop, saving F1's launch, was dropped: two
# accumulators through the loop serialised the wgmma pipeline in every config on sm_90.)
HYBRID_MIN_TOKENS = 2048
HYBRID_MIN_WEIGHT = 2048 * 2048
PATHS = ("fused", "hybrid")


def choose_path(m, n, k, r):
    """The path for x [m, k] through q [n, k] at rank r; STEP_LORA_PATH=fused|hybrid overrides the
    rule (default auto)."""
    path = os.environ.get("STEP_LORA_PATH", "auto")
    if path != "auto":
        if path not in PATHS:
            raise ValueError(f"STEP_LORA_PATH={path!r} is not one of auto, {', '.join(PATHS)}")
        return path
    return "hybrid" if m >= HYBRID_MIN_TOKENS and n * k >= HYBRID_MIN_WEIGHT else "fused"


def _triton_forward(x, q, scale, lora_a, lora_b, lora_scale, path):
    # x [M, K] compute dtype, any strides; q [N, K] int8 contiguous; scale [N] fp32; A [r, K]; B [N, r]
    dt = x.dtype
    a, b = lora_a.to(dt), lora_b.to(dt)
    if path == "hybrid":
        s = _lora_down(x, a)                                            # [M, r]
        y = torch.mm(x, _dequantize_to_scratch(q, scale, dt).t())       # [M, N]
        return y.addmm_(s, b.t(), alpha=lora_scale), s
    return _fused_forward(x, q, scale, a, b, lora_scale)


def _triton_backward(dy, x, q, scale, lora_a, lora_b, s, lora_scale, path, need_dx):
    dt = x.dtype
    a, b = lora_a.to(dt), lora_b.to(dt)
    dyb, da, db = _lora_backward(dy, x, b, s, _deterministic())
    dx = None
    if need_dx:
        if path == "hybrid":
            dx = torch.mm(dy, _dequantize_to_scratch(q, scale, dt))     # [M, K]
            dx.addmm_(dyb, a, alpha=lora_scale)
        else:
            dx = _fused_dx(dy, q, scale, a, dyb, lora_scale)
    return dx, (lora_scale * da).to(lora_a.dtype), (lora_scale * db).to(lora_b.dtype)


# ----------------------------------------------------------------------------------------------
# The op: torch.library custom ops, so that torch.compile keeps every frozen linear in its graph
# (it sees the fake below, never the launchers) and autograd saves only x and S. `path` is
# "reference" or one of PATHS; the forward also returns S = x·Aᵀ for the backward.

@torch.library.custom_op("step::frozen_lora_linear", mutates_args=())
def _op(x: torch.Tensor, q: torch.Tensor, scale: Optional[torch.Tensor], lora_a: torch.Tensor,
        lora_b: torch.Tensor, lora_scale: float, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        if path == "reference":
            return _reference_forward(x, q, scale, lora_a, lora_b, lora_scale)
        return _triton_forward(x, q, scale, lora_a, lora_b, lora_scale, path)


@_op.register_fake
def _(x, q, scale, lora_a, lora_b, lora_scale, path):
    return x.new_empty(x.shape[0], q.shape[0]), x.new_empty(x.shape[0], lora_a.shape[0])


@torch.library.custom_op("step::frozen_lora_linear_backward", mutates_args=())
def _op_backward(dy: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: Optional[torch.Tensor],
                 lora_a: torch.Tensor, lora_b: torch.Tensor, s: torch.Tensor, lora_scale: float, path: str,
                 need_dx: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> dX (empty when not needed: an op cannot return None), dA, dB
    with torch.autocast(x.device.type, enabled=False):
        dy = dy.to(x.dtype)
        if path == "reference":
            dx, da, db = _reference_backward(dy, x, q, scale, lora_a, lora_b, s, lora_scale, need_dx)
        else:
            dx, da, db = _triton_backward(dy, x, q, scale, lora_a, lora_b, s, lora_scale, path, need_dx)
    return (dx if need_dx else x.new_empty(0)), da, db


@_op_backward.register_fake
def _(dy, x, q, scale, lora_a, lora_b, s, lora_scale, path, need_dx):
    return (torch.empty_like(x) if need_dx else x.new_empty(0)), torch.empty_like(lora_a), torch.empty_like(lora_b)


def _setup_context(ctx, inputs, output):
    x, q, scale, lora_a, lora_b, lora_scale, path = inputs
    ctx.save_for_backward(x, q, scale, lora_a, lora_b, output[1])
    ctx.lora_scale, ctx.path = lora_scale, path


def _backward(ctx, dy, _ds):
    x, q, scale, lora_a, lora_b, s = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    dx, da, db = _op_backward(dy, x, q, scale, lora_a, lora_b, s, ctx.lora_scale, ctx.path, need_dx)
    return (dx if need_dx else None), None, None, da, db, None, None


_op.register_autograd(_backward, setup_context=_setup_context)


def _apply(x, q, scale, lora_a, lora_b, lora_scale, path):
    lead, k = x.shape[:-1], x.shape[-1]
    y, _ = _op(x.reshape(-1, k), q, scale, lora_a, lora_b, float(lora_scale), path)
    return y.reshape(*lead, q.shape[0])


def frozen_lora_linear_reference(x, q, scale, lora_a, lora_b, lora_scale):
    return _apply(x, q, scale, lora_a, lora_b, lora_scale, "reference")


def frozen_lora_linear_triton(x, q, scale, lora_a, lora_b, lora_scale, path=None):
    lead, k = x.shape[:-1], x.shape[-1]
    n, r = q.shape[0], lora_a.shape[0]
    # the kernels read raw memory, so a wrong shape would be silent garbage rather than an error
    assert q.shape == (n, k) and scale.shape == (n,), f"q {tuple(q.shape)}, scale {tuple(scale.shape)}"
    assert lora_a.shape == (r, k) and lora_b.shape == (n, r), \
        f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit r={r}, N={n}, K={k}"
    path = path or choose_path(x.numel() // k, n, k, r)
    return _apply(x, q.contiguous(), scale.float().contiguous(), lora_a, lora_b, lora_scale, path)


def _compute_dtype(x):
    # autocast does not reach inside a custom op, so take its dtype here, explicitly
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def frozen_lora_linear(x, q, scale, lora_a, lora_b, lora_scale):
    """x [..., K] -> y [..., N] for a frozen int8 weight q [N, K] (row scale [N]), or a float
    weight with scale None, plus LoRA A [r, K], B [N, r] scaled by lora_scale. Gradients flow to
    x, A and B, never to q."""
    assert x.shape[-1] == q.shape[1], f"x has K={x.shape[-1]} but the weight has K={q.shape[1]}"
    assert (q.dtype == torch.int8) == (scale is not None), f"an int8 weight needs its row scale; got {q.dtype}"
    x = x.to(_compute_dtype(x))
    # a bf16 store is a plain GEMM, which cuBLAS does best; without adapters (rank 0) there is
    # nothing to fuse; fp32 activations where torch forbids TF32 would make the kernels' dots plain
    # FMA, far slower than cuBLAS in fp32: all three take the reference path
    fp32_ok = x.dtype != torch.float32 or kernels.INTERPRET or torch.backends.cuda.matmul.allow_tf32
    if kernels.use_triton(x) and q.dtype == torch.int8 and lora_a.shape[0] > 0 and fp32_ok:
        return frozen_lora_linear_triton(x, q, scale, lora_a, lora_b, lora_scale)
    return frozen_lora_linear_reference(x, q, scale, lora_a, lora_b, lora_scale)
