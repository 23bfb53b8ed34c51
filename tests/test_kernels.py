"""Kernels against their oracles: quantisation against the torch reference (bit-exact), and the
frozen int8 + LoRA linear, forward and backward, against float64 autograd on the same q and scale.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); with CUDA the same
tests compile them for real, and the `gpu` tests add bf16 and full autotuning.
"""
import pytest
import torch

import kernels
from kernels import frozen_lora, quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the oracles, bound before `triton_only` replaces the module attributes with tripwires
_QUANT_REF = quant.quantize_int8_reference
_DEQUANT_REF = quant.dequantize_int8_reference

# max |out - oracle| / max |oracle|
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


AUTOTUNED = ("_fwd_kernel", "_dx_kernel", "_lora_down_kernel", "_lora_bwd_kernel")


@pytest.fixture(autouse=True)
def _clean_env(request, monkeypatch):
    torch.manual_seed(0)
    for name in ("STEP_LORA_PATH", "STEP_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    if DEVICE == "cuda" and request.node.get_closest_marker("gpu") is None:
        # with CUDA every test compiles for real; tuning every small shape would take many
        # minutes, so only the `gpu` tests run the full config sets
        for name in AUTOTUNED:
            kernel = getattr(frozen_lora, name)
            monkeypatch.setattr(kernel, "configs", kernel.configs[:1])


@pytest.fixture
def triton_only(monkeypatch):
    """Route the public API to Triton, make the references unreachable from it, and poison every
    buffer a kernel allocates so that an element it fails to write shows up as NaN (or -128)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("STEP_KERNELS", "triton")

    def unreachable(*args, **kwargs):
        raise AssertionError("the reference ran although STEP_KERNELS=triton")

    def poisoned(shape, dtype, device):
        fill = -128 if dtype == torch.int8 else float("nan")
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(frozen_lora, "frozen_lora_linear_reference", unreachable)
    monkeypatch.setattr(quant, "quantize_int8_reference", unreachable)
    monkeypatch.setattr(quant, "dequantize_int8_reference", unreachable)
    monkeypatch.setattr(quant, "_empty", poisoned)
    monkeypatch.setattr(frozen_lora, "_empty", poisoned)
    monkeypatch.setattr(frozen_lora, "_SCRATCH", {})


def rel_err(out, oracle):
    assert torch.isfinite(out).all(), "non-finite values: an output element was not written"
    return ((out.double() - oracle).abs().max() / oracle.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# quantisation

def _weight(n, k, dtype=torch.float32):
    w = torch.randn(n, k, device=DEVICE) * torch.rand(n, 1, device=DEVICE) * 3
    w[1] = 0                                                       # all-zero row -> scale 1
    w[2, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])          # scale 1: exact halves
    return w.to(dtype)


def _check_roundtrip(w, q, scale):
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == w.shape and scale.shape == (w.shape[0],)
    assert q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w.float()).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert scale[1] == 1 and (q[1] == 0).all()
    # torch.round sends halves to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2
    assert q[2, :5].tolist() == [127, 0, 2, 2, -2]


def test_quantize_reference_roundtrip():
    w = _weight(37, 301)
    _check_roundtrip(w, *quant.quantize_int8_reference(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_triton_equals_reference(triton_only, dtype):
    w = _weight(37, 1100, dtype)                                   # 1100: three ragged K blocks
    q_ref, scale_ref = _QUANT_REF(w)
    q, scale = kernels.quantize_int8(w)
    _check_roundtrip(w, q, scale)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    # a strided weight reads the same
    wt = w.t().contiguous().t()
    q_t, scale_t = kernels.quantize_int8(wt)
    assert torch.equal(q_t, q_ref) and torch.equal(scale_t, scale_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_triton_equals_reference(triton_only, dtype):
    q, scale = _QUANT_REF(_weight(37, 301))
    out = kernels.dequantize_int8(q, scale, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, _DEQUANT_REF(q, scale, dtype))


# ---------------------------------------------------------------------------------------------
# frozen int8 + LoRA linear

def _problem(lead, n, k, r, dtype, strided):
    """Inputs for one call; `strided` makes x and dY non-contiguous (x read with a K-stride of 2,
    dY transposed in memory)."""
    q, scale = _QUANT_REF(torch.randn(n, k, device=DEVICE))
    if strided:
        x = torch.randn(*lead, 2 * k, device=DEVICE)[..., ::2].to(dtype)
        dy = torch.randn(n, *lead, device=DEVICE).movedim(0, -1).to(dtype)
    else:
        x = torch.randn(*lead, k, device=DEVICE).to(dtype)
        dy = torch.randn(*lead, n, device=DEVICE).to(dtype)
    # fp32 masters, as the model keeps them; the ops cast them to x's dtype
    a = torch.randn(r, k, device=DEVICE) / k ** 0.5
    b = torch.randn(n, r, device=DEVICE) / r ** 0.5
    return x, q, scale, a, b, dy


def _float64_oracle(x, q, scale, a, b, lora_scale, dy):
    # from the compute-dtype values the op sees (A and B cast to x's dtype), in float64 throughout
    x64 = x.detach().double().requires_grad_()
    a64 = a.detach().to(x.dtype).double().requires_grad_()
    b64 = b.detach().to(x.dtype).double().requires_grad_()
    w64 = q.double() * scale.double()[:, None]
    y64 = x64 @ w64.t() + lora_scale * (x64 @ a64.t()) @ b64.t()
    y64.backward(dy.double())
    return y64.detach(), x64.grad, a64.grad, b64.grad


def _run_and_check(lead, n, k, r, dtype, strided=False, lora_scale=2.0):
    x, q, scale, a, b, dy = _problem(lead, n, k, r, dtype, strided)
    x.requires_grad_()
    a.requires_grad_()
    b.requires_grad_()
    y = kernels.frozen_lora_linear(x, q, scale, a, b, lora_scale)
    assert y.shape == (*lead, n) and y.dtype == dtype
    y.backward(dy)
    assert a.grad.dtype == a.dtype and b.grad.dtype == b.dtype     # grads in the params' dtype
    oracle = _float64_oracle(x, q, scale, a, b, lora_scale, dy)
    for name, out, ref in zip(("y", "dx", "dA", "dB"), (y, x.grad, a.grad, b.grad), oracle):
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e}"
    return y, x.grad, a.grad, b.grad


# (leading dims, N, K, r): ragged everywhere; (150, 140, 200) spans several default tiles
SHAPES = [((37,), 45, 29, 8), ((70,), 33, 81, 24), ((3, 13), 40, 56, 128), ((150,), 140, 200, 16)]


@pytest.mark.parametrize("path", frozen_lora.PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,n,k,r", SHAPES)
def test_frozen_lora_triton_matches_float64(triton_only, monkeypatch, lead, n, k, r, dtype, path):
    monkeypatch.setenv("STEP_LORA_PATH", path)
    _run_and_check(lead, n, k, r, dtype, strided=(r % 16 == 8))   # two of the four shapes strided


# 16- and 32-wide tiles put many tiles, GROUP_M groups and K-steps into a small problem
_TINY_CONFIGS = {
    "_fwd_kernel": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2),
    "_dx_kernel": dict(BLOCK_M=32, BLOCK_K=16, BLOCK_N=16, GROUP_M=2),
    "_lora_down_kernel": dict(BLOCK_M=16, BLOCK_K=16),
    "_lora_bwd_kernel": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16),
}


@pytest.fixture
def tiny_tiles(monkeypatch):
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    import triton
    for name, tiles in _TINY_CONFIGS.items():
        monkeypatch.setattr(getattr(frozen_lora, name), "configs",
                            [triton.Config(tiles, num_stages=2, num_warps=4)])


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_frozen_lora_triton_small_tiles(triton_only, tiny_tiles, monkeypatch, path):
    monkeypatch.setenv("STEP_LORA_PATH", path)
    _run_and_check((70,), 75, 83, 24, torch.float32, strided=True)


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_deterministic_mode_is_bit_identical(triton_only, tiny_tiles, monkeypatch, path):
    # 10 row blocks over fewer programs: each program sums several blocks into its own slice
    monkeypatch.setenv("STEP_LORA_PATH", path)
    monkeypatch.setenv("STEP_DETERMINISTIC", "1")
    torch.manual_seed(1)
    first = _run_and_check((150,), 45, 70, 16, torch.float32)
    torch.manual_seed(1)
    second = _run_and_check((150,), 45, 70, 16, torch.float32)
    for u, v in zip(first, second):
        assert torch.equal(u, v)


def test_deterministic_flag_sources(monkeypatch):
    assert not frozen_lora._deterministic()
    monkeypatch.setenv("STEP_DETERMINISTIC", "1")
    assert frozen_lora._deterministic()
    monkeypatch.delenv("STEP_DETERMINISTIC")
    torch.use_deterministic_algorithms(True)
    try:
        assert frozen_lora._deterministic()
    finally:
        torch.use_deterministic_algorithms(False)


def test_autocast_and_frozen_inputs(triton_only):
    # fp32 x under fp16 autocast computes in fp16 and returns fp32 grads to fp32 masters; a frozen
    # input (no grad for x) skips dX
    x, q, scale, a, b, _ = _problem((20,), 24, 40, 8, torch.float32, strided=False)
    a.requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.float16):
        y = kernels.frozen_lora_linear(x, q, scale, a, b, 0.5)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad is None and x.grad is None
    ones = torch.ones_like(y)
    oracle = _float64_oracle(x.half(), q, scale, a, b, 0.5, ones)
    assert rel_err(y, oracle[0]) < TOL[torch.float16]
    assert rel_err(a.grad, oracle[2]) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,n,k,r", SHAPES[:3])
def test_frozen_lora_reference_matches_float64(monkeypatch, lead, n, k, r, dtype):
    if DEVICE == "cpu" and dtype == torch.float16 and not _cpu_half_matmul():
        pytest.skip("this torch build has no fp16 matmul on CPU")
    monkeypatch.setenv("STEP_KERNELS", "reference")
    _run_and_check(lead, n, k, r, dtype, strided=True)


def _cpu_half_matmul():
    try:
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
        return True
    except RuntimeError:
        return False


def test_reference_gradcheck():
    q, scale = _QUANT_REF(torch.randn(7, 11))
    x = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    def fn(x, a, b):
        return frozen_lora.frozen_lora_linear_reference(x, q, scale.double(), a, b, 1.5)
    assert torch.autograd.gradcheck(fn, (x, a, b))


def test_choose_path_rule_and_override(monkeypatch):
    big = (frozen_lora.HYBRID_MIN_TOKENS, 2048, 2048)
    assert frozen_lora.choose_path(*big, 16) == "hybrid"
    assert frozen_lora.choose_path(1024, 2048, 2048, 16) == "fused"
    assert frozen_lora.choose_path(8192, 1024, 1024, 16) == "fused-recompute"
    assert frozen_lora.choose_path(8192, 1024, 1024, 64) == "fused"
    monkeypatch.setenv("STEP_LORA_PATH", "fused")
    assert frozen_lora.choose_path(*big, 16) == "fused"
    monkeypatch.setenv("STEP_LORA_PATH", "cublas")
    with pytest.raises(ValueError):
        frozen_lora.choose_path(*big, 16)


def test_dispatch_env(monkeypatch):
    monkeypatch.setenv("STEP_KERNELS", "reference")
    assert not kernels.use_triton(torch.ones(1))
    monkeypatch.setenv("STEP_KERNELS", "bogus")
    with pytest.raises(ValueError):
        kernels.use_triton(torch.ones(1))


# ---------------------------------------------------------------------------------------------
# GPU only: bf16 (broken in the interpreter), real compilation with the whole autotune config set

def _gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


@_gpu
@pytest.mark.parametrize("path", frozen_lora.PATHS)
@pytest.mark.parametrize("lead,n,k,r", SHAPES)
def test_frozen_lora_cuda_bf16(triton_only, monkeypatch, lead, n, k, r, path):
    for name in AUTOTUNED:  # ragged shapes with the first configs; tuning is the next test's job
        kernel = getattr(frozen_lora, name)
        monkeypatch.setattr(kernel, "configs", kernel.configs[:1])
    monkeypatch.setenv("STEP_LORA_PATH", path)
    _run_and_check(lead, n, k, r, torch.bfloat16, strided=(r % 16 == 8))


@_gpu
@pytest.mark.parametrize("deterministic", ["0", "1"])
@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_frozen_lora_cuda_autotuned(triton_only, monkeypatch, path, deterministic):
    assert len(frozen_lora._fwd_kernel.configs) > 1, "with CUDA the full config sets are tuned"
    monkeypatch.setenv("STEP_LORA_PATH", path)
    monkeypatch.setenv("STEP_DETERMINISTIC", deterministic)
    torch.manual_seed(1)
    first = _run_and_check((4, 600), 1024, 768, 16, torch.bfloat16)
    if deterministic == "1":  # on a GPU, unlike in the interpreter, atomics would make this fail
        torch.manual_seed(1)
        second = _run_and_check((4, 600), 1024, 768, 16, torch.bfloat16)
        assert all(torch.equal(u, v) for u, v in zip(first, second))


@_gpu
def test_quantize_cuda_bf16(triton_only):
    w = _weight(2736, 1024, torch.bfloat16)
    q, scale = kernels.quantize_int8(w)
    assert torch.equal(q, _QUANT_REF(w)[0]) and torch.equal(scale, _QUANT_REF(w)[1])
    assert torch.equal(kernels.dequantize_int8(q, scale, torch.bfloat16),
                       _DEQUANT_REF(q, scale, torch.bfloat16))
