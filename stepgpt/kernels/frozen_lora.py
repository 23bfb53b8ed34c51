"""Triton kernels for the frozen linear of frozen_linear.py, y = x·(q·scale)ᵀ + s·(x·Aᵀ)·Bᵀ, and
its backward. frozen_linear.py holds the same math in plain PyTorch: the CPU path and the oracle
that tests/test_kernels.py compares these kernels with (in float64). Per layer and step:

  F1 _lora_down_kernel  S   = x·Aᵀ                               [M, r]  memory-bound, saved for B1
  F2 _fwd_kernel        y   = (x·Qᵀ)·diag(scale) + s·S·Bᵀ        [M, N]  main GEMM
  B1 _lora_bwd_kernel   dYB = dY·B,  dB = s·dYᵀ·S,  dA = s·dYBᵀ·x        one pass over dY and over x
  B3 _dx_kernel         dX  = (dY·diag(scale))·Q + s·dYB·A       [M, K]  main GEMM

Q is dequantised tile by tile in registers inside the K-loop (q·scale rounded once to the compute
dtype) and never written to memory. All accumulation is fp32. bench/compile_kernels.py compiles
every kernel for sm_90 and checks spills, shared memory and serialised wgmma pipelines on every CI
run. Two paths: "fused" (the kernels above) and "hybrid" (the weight dequantised into a reused
scratch buffer, cuBLAS for the two main GEMMs, F1/B1 for the low-rank side); kernels.choose_path()
picks.
"""
import contextlib
import os

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # no triton wheel (macOS, Windows): the module stays importable, the reference runs
    from types import SimpleNamespace
    HAS_TRITON = False
    triton = SimpleNamespace(jit=lambda fn: fn, autotune=lambda *args, **kw: (lambda fn: fn),
                             Config=lambda *args, **kw: None, __version__="0.0")
    tl = SimpleNamespace(constexpr=None)

# Triton reads TRITON_INTERPRET when the kernels below are decorated: it must be set before import
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _version(text):   # "3.6.0" -> (3, 6)
    return tuple(int(part) for part in text.split(".")[:2])


# Supported: triton 3.6 and later (torch 2.11's CUDA wheels bring 3.6). Two things differ in 3.6:
# B3's 128x128x64 tile at 4 warps spills (see _DX_ROWS), and its interpreter, which runs the kernels
# on CPU tensors, fails under numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python
# scalars"; 3.7 and later run under it). Where the interpreter cannot run here, this says why.
TRITON_36 = HAS_TRITON and _version(triton.__version__) < (3, 7)
INTERPRETER_PROBLEM = (f"triton {triton.__version__}'s interpreter needs numpy < 2.4 (numpy {np.__version__} "
                       "is installed): pip install 'numpy<2.4'"
                       if TRITON_36 and _version(np.__version__) >= (2, 4) else None)


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
# Conventions: tensors are row-major with explicit strides; the LoRA rank r lives in one tile of
# R_PAD = max(16, next_pow2(r)) columns (tl.dot needs >= 16) and is masked to r. Row offsets that
# multiply an activation stride are int64, since M·K passes 2**31 at long contexts.

# Under the interpreter (or without CUDA) the autotuner cannot benchmark, so only the first config
# of each list is used: keep it small enough for quick interpreted tests and valid on any GPU.
_ONE_CONFIG = INTERPRET or not torch.cuda.is_available()


def _configs(names, rows, **fixed):
    # each row: the tile sizes named in `names`, then num_stages, num_warps
    return [triton.Config(dict(zip(names, row[:-2]), **fixed), num_stages=row[-2], num_warps=row[-1])
            for row in rows]


def _tuned(configs):
    return configs[:1] if _ONE_CONFIG else configs


DECODE_M = 128


def m_bucket(m):
    return 0 if m <= DECODE_M else triton.next_power_of_2(m)


def _first_if_decode(configs, named_args, **kwargs):
    # an autotuner given one config runs it without benchmarking
    return configs[:1] if named_args["M_BUCKET"] == 0 else configs


def _autotune(configs, key=("M_BUCKET", "N", "K", "R"), **kw):
    return triton.autotune(configs=_tuned(configs), key=list(key),
                           prune_configs_by={"early_config_prune": _first_if_decode}, **kw)


# Autotune keys name (M_BUCKET, N, K, R); Triton adds every tensor argument's dtype to the key
# itself. M_BUCKET is M rounded up to a power of two, so a run tunes each kernel and shape for a
# few token counts (training, eval), not for every M that sampling passes; M <= DECODE_M is bucket
# 0, which takes the first config of each list untuned (_first_if_decode). Configs that do not fit
# (shared memory, registers) are skipped by the tuner.
# main GEMMs (F2, B3): the Triton-tutorial / LoRAFusion Hopper set plus a small-M tile
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
# CONVERT: how the int8 tile becomes the MMA's operand, see _fwd_kernel; both are tuned
_FWD_CONFIGS = [c for conv in ("direct", "fp32")
                for c in _configs(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"), _MAIN_ROWS, CONVERT=conv)]
# triton 3.6 spills 12 B in B3 at 128x128x64 with 4 warps (255 registers; 3.7 to 3.9 fit it in 254-255
# without a spill, bench/compile_kernels.py): the main GEMMs are held to no spills, so 3.6 does not tune it
_DX_ROWS = [row for row in _MAIN_ROWS if not (TRITON_36 and row == (128, 128, 64, 8, 4, 4))]
_DX_CONFIGS = [c for conv in ("direct", "fp32")
               for c in _configs(("BLOCK_M", "BLOCK_K", "BLOCK_N", "GROUP_M"), _DX_ROWS, CONVERT=conv)]
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


@_autotune(_DOWN_CONFIGS, key=("M_BUCKET", "K", "R"))
@triton.jit
def _lora_down_kernel(x_ptr, a_ptr, s_ptr, M, M_BUCKET, K, R, stride_xm, stride_xk, stride_ar, stride_ak,
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


@_autotune(_FWD_CONFIGS)
@triton.jit
def _fwd_kernel(x_ptr, q_ptr, scale_ptr, b_ptr, s_ptr, y_ptr, lora_scale, M, M_BUCKET, N, K, R,
                stride_xm, stride_xk, stride_bn, stride_br,
                PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, CONVERT: tl.constexpr):
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
    scale = tl.load(scale_ptr + offs_n)                                                        # [BN] fp32
    if CONVERT == "direct":   # the row scale waits for the epilogue, so the low-rank term is divided by it
        bt = (bt.to(tl.float32) * (lora_scale / scale[:, None])).to(dt)
    else:
        bt = (bt.to(tl.float32) * lora_scale).to(dt)
    acc = tl.dot(bt, st, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), input_precision=PRECISION)  # yᵀ
    q_ptrs = q_ptr + offs_n[:, None] * K + offs_k[None, :]                                     # [BN, BK]
    xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk   # [BK, BM]
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        q = tl.load(q_ptrs, mask=k_ok[None, :], other=0)
        xt = tl.load(xt_ptrs, mask=k_ok[:, None], other=0.0)
        # dequantised in registers with the row scale and rounded once, as the hybrid path's
        # weight is; the dequantised weight never exists in memory
        if CONVERT == "direct":
            # exact (|q| <= 127 in bf16's 8 bits), and lowered to byte permutes and bf16x2
            # arithmetic: no I2F or F2FP, whose throughput on Hopper can bound this loop
            w = q.to(dt)
        else:   # dequantised with the row scale and rounded once: I2F, FMUL and F2FP per element
            w = (q.to(tl.float32) * scale[:, None]).to(dt)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        q_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K * stride_xk
    y_ptrs = y_ptr + tile_m[None, :].to(tl.int64) * N + tile_n[:, None]
    if CONVERT == "direct":
        acc = acc * scale[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(tile_n[:, None] < N) & (tile_m[None, :] < M))


@_autotune(_BWD_CONFIGS, reset_to_zero=["da_ptr", "db_ptr"])
@triton.jit
def _lora_bwd_kernel(dy_ptr, x_ptr, b_ptr, s_ptr, dyb_ptr, da_ptr, db_ptr, M, M_BUCKET, N, K, R, SLICES,
                     stride_dym, stride_dyn, stride_xm, stride_xk, stride_bn, stride_br,
                     PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # B1 + B2: a program owns whole row blocks of dY, so dYB = dY·B is complete in registers after
    # one sweep over N and is multiplied into x at once: dY and x are each read once. dB and dA sum
    # over all rows. The rows are cut into SLICES contiguous slices; each slice's sums go into its
    # own part [slice] of fp32 partial buffers, row block after row block, and the launcher adds the
    # parts in a fixed order. No atomics: the result is the same bit for bit on every run, and for
    # any number of programs (each program takes slices pid, pid + P, ...).
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    blocks = tl.cdiv(M, BLOCK_M)
    per_slice = tl.cdiv(blocks, SLICES)
    for part in range(tl.program_id(0), SLICES, tl.num_programs(0)):
        # int32 offsets suffice: the partial buffers hold at most PARTIAL_BYTES / 4 elements
        db_part = db_ptr + part * N * R                                     # db: [SLICES, N, R] fp32
        da_part = da_ptr + part * R * K                                     # da: [SLICES, R, K] fp32
        for mb in range(part * per_slice, tl.minimum(blocks, (part + 1) * per_slice)):
            tl.debug_barrier()   # the previous row block's partial-sum stores are visible to every thread
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
                db_ptrs = db_part + offs_n[:, None] * R + offs_r[None, :]
                db_mask = n_ok[:, None] & r_ok[None, :]
                db = tl.dot(tl.trans(dy), s, input_precision=PRECISION)                      # [BN, R_PAD]
                tl.store(db_ptrs, tl.load(db_ptrs, mask=db_mask, other=0.0) + db, mask=db_mask)
            # rounded to the compute dtype, as in the reference; B3 reads it back for dX's low-rank term
            dyb = dyb.to(dyb_ptr.dtype.element_ty)
            tl.store(dyb_ptr + rows * R + offs_r[None, :], dyb, mask=m_ok[:, None] & r_ok[None, :])
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :] * stride_xk,
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)                   # [BM, BK]
                da_ptrs = da_part + offs_r[:, None] * K + offs_k[None, :]
                da_mask = r_ok[:, None] & k_ok[None, :]
                da = tl.dot(tl.trans(dyb), x, input_precision=PRECISION)                     # [R_PAD, BK]
                tl.store(da_ptrs, tl.load(da_ptrs, mask=da_mask, other=0.0) + da, mask=da_mask)


@_autotune(_DX_CONFIGS)
@triton.jit
def _dx_kernel(dy_ptr, q_ptr, scale_ptr, a_ptr, dyb_ptr, dx_ptr, lora_scale, M, M_BUCKET, N, K, R,
               stride_dym, stride_dyn, stride_ar, stride_ak,
               PRECISION: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_M: tl.constexpr, CONVERT: tl.constexpr):
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
        scale = tl.load(scale_ptr + n0 + offs_n, mask=n_ok, other=0.0)                          # [BN] fp32
        # the scale varies along the reduction, so it multiplies the converted tile (scaling the dY
        # tile instead would pull that shared-memory operand into registers and back, and spill)
        if CONVERT == "direct":   # a direct cast as in F2, the scale applied in bf16x2 arithmetic
            wt = qt.to(dt) * scale.to(dt)[None, :]
        else:
            wt = (qt.to(tl.float32) * scale[None, :]).to(dt)
        acc = tl.dot(wt, dyt, acc, input_precision=PRECISION)
        qt_ptrs += BLOCK_N * K
        dyt_ptrs += BLOCK_N * stride_dyn

    dx_ptrs = dx_ptr + tile_m[None, :].to(tl.int64) * K + tile_k[:, None]
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(tile_k[:, None] < K) & (tile_m[None, :] < M))


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr + rows, mask=rows < N, other=1.0)
    w = q.to(tl.float32) * scale[:, None]               # fp32 product, rounded once, as in F2 and B3
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask)


# without triton the stand-in decorators leave plain functions: there is nothing autotuned to save or load
AUTOTUNED = {"_lora_down_kernel": _lora_down_kernel, "_fwd_kernel": _fwd_kernel,
             "_lora_bwd_kernel": _lora_bwd_kernel, "_dx_kernel": _dx_kernel} if HAS_TRITON else {}
CONFIGS = {"_lora_down_kernel": _DOWN_CONFIGS, "_fwd_kernel": _FWD_CONFIGS, "_lora_bwd_kernel": _BWD_CONFIGS,
           "_dx_kernel": _DX_CONFIGS}   # the full lists (AUTOTUNED's hold the first alone without a GPU)


# ----------------------------------------------------------------------------------------------
# Launchers

def on_device(device):
    """The tensors' CUDA device made current: Triton launches a kernel (and CUDA events record) on
    the current device, not on the device of the pointers it is given, and a caller that never set
    one (bench/step_time.py --set device=cuda:1) would launch on device 0 into device 1's memory."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dequantize(q, scale, dtype, out=None):
    """(q int8 [N, K], scale [N]) -> q·scale [N, K] in `dtype`, into `out` if given."""
    n, k = q.shape
    out = torch.empty((n, k), dtype=dtype, device=q.device) if out is None else out
    grid = (triton.cdiv(n, 16), triton.cdiv(k, 256))
    with on_device(q.device):
        _dequantize_kernel[grid](q, scale, out, n, k, BLOCK_N=16, BLOCK_K=256)
    return out


def _r_pad(r):
    return max(16, triton.next_power_of_2(r))


def _dot_precision(dtype):
    # fp32 activations follow torch's own matmul setting: TF32 only where torch would use it too
    if dtype == torch.float32 and (INTERPRET or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"  # Triton's default; fp16/bf16 operands ignore it


def _lora_down(x, a):
    m, k = x.shape
    r = a.shape[0]
    s = torch.empty((m, r), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)  # noqa: E731
    _lora_down_kernel[grid](x, a, s, m, m_bucket(m), k, r, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                            PRECISION=_dot_precision(x.dtype), R_PAD=_r_pad(r))
    return s


def _fused_forward(x, q, scale, a, b, lora_scale):
    m, k = x.shape
    n, r = q.shape[0], a.shape[0]
    s = _lora_down(x, a)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _fwd_kernel[grid](x, q, scale, b, s, y, lora_scale, m, m_bucket(m), n, k, r,
                      x.stride(0), x.stride(1), b.stride(0), b.stride(1),
                      PRECISION=_dot_precision(x.dtype), R_PAD=_r_pad(r))
    return y, s


# dA and dB are summed over the rows in SLICES parts: fp32 partial buffers of SLICES·(N+K)·r·4
# bytes, capped. SLICES depends on the shape alone (never on the GPU's size), so a result does not
# either; with about one program per slice, up to the GPU's multiprocessor count, B1 fills the GPU.
MAX_SLICES = 132
PARTIAL_BYTES = 128 << 20
CPU_PROGRAMS = 4   # the interpreter's stand-in for a multiprocessor count


def _lora_backward(dy, x, b, s):
    """-> dYB [M, r] (compute dtype), dA [r, K] and dB [N, r] (fp32, not yet times lora_scale)."""
    m, k = x.shape
    n, r = b.shape
    slices = max(1, min(MAX_SLICES, triton.cdiv(m, 64), PARTIAL_BYTES // ((n + k) * r * 4)))
    programs = CPU_PROGRAMS
    if dy.is_cuda:
        programs = torch.cuda.get_device_properties(dy.device).multi_processor_count
    dyb = torch.empty((m, r), dtype=dy.dtype, device=dy.device)
    da = torch.zeros((slices, r, k), dtype=torch.float32, device=dy.device)
    db = torch.zeros((slices, n, r), dtype=torch.float32, device=dy.device)
    _lora_bwd_kernel[(min(programs, slices),)](dy, x, b, s, dyb, da, db, m, m_bucket(m), n, k, r, slices,
                                               dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                                               b.stride(0), b.stride(1), PRECISION=_dot_precision(dy.dtype),
                                               R_PAD=_r_pad(r))
    return dyb, da.sum(0), db.sum(0)   # a fixed-order sum over the slices


def _fused_dx(dy, q, scale, a, dyb, lora_scale):
    m, n = dy.shape
    r, k = a.shape
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_K"]),)  # noqa: E731
    _dx_kernel[grid](dy, q, scale, a, dyb, dx, lora_scale, m, m_bucket(m), n, k, r,
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
        _SCRATCH[key] = torch.empty(q.numel(), dtype=dtype, device=q.device)
    w = _SCRATCH[key].narrow(0, 0, q.numel()).view(q.shape)
    return dequantize(q, scale, dtype, out=w)


PATHS = ("fused", "hybrid")   # the Triton paths: stepgpt/kernels/__init__.py picks one, or the reference


def forward(path, x, q, scale, lora_a, lora_b, lora_scale):
    """frozen_linear.forward on the Triton path `path`: x [M, K] in the compute dtype, q [N, K]
    int8, scale [N] fp32, A [r, K], B [N, r] -> (y [M, N], S = x·Aᵀ [M, r])."""
    m, k = x.shape
    n, r = q.shape[0], lora_a.shape[0]
    # the kernels read raw memory, so a wrong shape would be silent garbage rather than an error
    assert q.shape == (n, k) and scale.shape == (n,), f"q {tuple(q.shape)}, scale {tuple(scale.shape)}"
    assert lora_a.shape == (r, k) and lora_b.shape == (n, r), \
        f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit r={r}, N={n}, K={k}"
    q, scale = q.contiguous(), scale.float().contiguous()
    dt = x.dtype
    a, b = lora_a.to(dt), lora_b.to(dt)
    with on_device(x.device):
        if path == "hybrid":
            s = _lora_down(x, a)                                            # [M, r]
            y = torch.mm(x, _dequantize_to_scratch(q, scale, dt).t())       # [M, N]
            return y.addmm_(s, b.t(), alpha=lora_scale), s
        return _fused_forward(x, q, scale, a, b, lora_scale)


def backward(path, dy, x, q, scale, lora_a, lora_b, s, lora_scale, need_dx):
    """frozen_linear.backward on the Triton path `path` -> (dX or None, dA, dB)."""
    q, scale = q.contiguous(), scale.float().contiguous()
    dt = x.dtype
    a, b = lora_a.to(dt), lora_b.to(dt)
    dx = None
    with on_device(x.device):
        dyb, da, db = _lora_backward(dy, x, b, s)
        if need_dx and path == "hybrid":
            dx = torch.mm(dy, _dequantize_to_scratch(q, scale, dt))     # [M, K]
            dx.addmm_(dyb, a, alpha=lora_scale)
        elif need_dx:
            dx = _fused_dx(dy, q, scale, a, dyb, lora_scale)
    return dx, (lora_scale * da).to(lora_a.dtype), (lora_scale * db).to(lora_b.dtype)
