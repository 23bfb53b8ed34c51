"""The Triton kernels against their oracles: the frozen int8 + LoRA linear, forward and backward,
against float64 autograd on the same q and scale, and the dequantisation against PyTorch (exact).

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); with CUDA the same
tests compile them for real, and the `gpu` tests add bf16 and full autotuning.
"""
import pytest
import torch

import frozen_linear
from model import quantize_int8
from stepgpt import kernels
from stepgpt.kernels import frozen_lora

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

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

    monkeypatch.setattr(frozen_linear, "forward", unreachable)
    monkeypatch.setattr(frozen_linear, "backward", unreachable)
    monkeypatch.setattr(frozen_linear, "weight", unreachable)
    monkeypatch.setattr(frozen_lora, "_empty", poisoned)
    monkeypatch.setattr(frozen_lora, "_SCRATCH", {})


def rel_err(out, oracle):
    assert torch.isfinite(out).all(), "non-finite values: an output element was not written"
    return ((out.double() - oracle).abs().max() / oracle.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# dequantisation (the hybrid path's first half)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_triton_equals_pytorch(triton_only, dtype):
    w = torch.randn(37, 301, device=DEVICE) * torch.rand(37, 1, device=DEVICE) * 3
    q, scale = quantize_int8(w)
    out = frozen_lora.dequantize(q, scale, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, (q.float() * scale[:, None]).to(dtype))


# ---------------------------------------------------------------------------------------------
# frozen int8 + LoRA linear

def _problem(lead, n, k, r, dtype, strided):
    """Inputs for one call; `strided` makes x and dY non-contiguous (x read with a K-stride of 2,
    dY transposed in memory)."""
    q, scale = quantize_int8(torch.randn(n, k, device=DEVICE))
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
    y = frozen_linear.frozen_lora_linear(x, q, scale, a, b, lora_scale)
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


@pytest.fixture
def program_order(monkeypatch):
    """Makes the interpreter run a kernel's programs in a shuffled order, as a GPU may: set
    `order.seed` to choose the permutation (None: the interpreter's own sequential order). Without
    it the interpreter's atomics always add up in the same order and no test could see nondeterminism."""
    if not kernels.INTERPRET:
        pytest.skip("reorders the Triton interpreter's programs")
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    state = type("Order", (), {"seed": None, "perm": None})()
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx

    def grid_dim(nx, ny, nz):
        state.perm = (torch.randperm(nx, generator=torch.Generator().manual_seed(state.seed)).tolist()
                      if state.seed is not None else list(range(nx)))
        set_dim(nx, ny, nz)

    monkeypatch.setattr(builder, "set_grid_dim", grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(state.perm[x], y, z))
    return state


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_deterministic_mode_is_bit_identical_in_any_program_order(triton_only, tiny_tiles, program_order,
                                                                   monkeypatch, path):
    # 10 row blocks: the default mode adds them into dA and dB atomically, in whatever order the
    # programs run; the deterministic mode gives each program its own slice and sums them in order
    monkeypatch.setenv("STEP_LORA_PATH", path)

    def grads(deterministic, seed):
        monkeypatch.setenv("STEP_DETERMINISTIC", "1" if deterministic else "0")
        program_order.seed = seed
        torch.manual_seed(1)
        return _run_and_check((150,), 45, 70, 16, torch.float32)

    # the control: with atomics, another program order changes dA or dB in the last bits
    plain = [grads(False, seed) for seed in (None, 1, 2)]
    assert any(not torch.equal(plain[0][i], other[i]) for other in plain[1:] for i in (2, 3))
    first = grads(True, None)
    for seed in (1, 2):
        assert all(torch.equal(u, v) for u, v in zip(first, grads(True, seed)))


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


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_autocast_and_frozen_inputs(triton_only, monkeypatch, path):
    # fp32 x under fp16 autocast computes in fp16 and returns fp32 grads to fp32 masters. An input
    # that needs no gradient (the embedding output of a frozen stack, say) skips the dX GEMM: the
    # backward's dX entry points (the fused kernel's launcher; the hybrid path's dequantised weight)
    # are tripwires, and a control with x requiring grad shows that they are on the path.
    monkeypatch.setenv("STEP_LORA_PATH", path)
    scratch = frozen_lora._dequantize_to_scratch
    phase = {"backward": False}

    def dx_tripwire(*args, **kwargs):
        if phase["backward"]:
            raise AssertionError("dX was computed")
        return scratch(*args, **kwargs)

    monkeypatch.setattr(frozen_lora, "_fused_dx", dx_tripwire)
    monkeypatch.setattr(frozen_lora, "_dequantize_to_scratch", dx_tripwire)
    x, q, scale, a, b, _ = _problem((20,), 24, 40, 8, torch.float32, strided=False)
    a.requires_grad_()
    for x_needs_grad in (False, True):
        x.requires_grad_(x_needs_grad)
        phase["backward"] = False
        with torch.autocast(DEVICE, dtype=torch.float16):
            y = frozen_linear.frozen_lora_linear(x, q, scale, a, b, 0.5)
        assert y.dtype == torch.float16
        phase["backward"] = True
        if x_needs_grad:
            with pytest.raises(AssertionError, match="dX was computed"):
                y.float().sum().backward()
        else:
            y.float().sum().backward()
            assert a.grad.dtype == torch.float32 and x.grad is None
            oracle = _float64_oracle(x.half(), q, scale, a, b, 0.5, torch.ones_like(y))
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
    q, scale = quantize_int8(torch.randn(7, 11))
    x = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    def fn(x, a, b):
        return frozen_linear.frozen_lora_linear(x, q, scale.double(), a, b, 1.5, path="reference")
    assert torch.autograd.gradcheck(fn, (x, a, b))


def test_choose_path_rule_and_override(monkeypatch):
    big = (frozen_lora.HYBRID_MIN_TOKENS, 2048, 2048)
    assert frozen_lora.triton_path(*big, 16) == "hybrid"
    assert frozen_lora.triton_path(1024, 2048, 2048, 16) == "fused"
    assert frozen_lora.triton_path(8192, 1024, 1024, 16) == "fused"
    monkeypatch.setenv("STEP_LORA_PATH", "fused")
    assert frozen_lora.triton_path(*big, 16) == "fused"
    monkeypatch.setenv("STEP_LORA_PATH", "cublas")
    with pytest.raises(ValueError):
        frozen_lora.triton_path(*big, 16)


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


# ---------------------------------------------------------------------------------------------
# the custom ops: schema, fake (meta) functions and autograd registration as torch.library checks them

def _op_inputs(store, r=8):
    q, scale = quantize_int8(torch.randn(24, 40, device=DEVICE))
    if store == "bf16":
        q, scale = (q.float() * scale[:, None]).bfloat16(), None
    x = torch.randn(20, 40, device=DEVICE, requires_grad=True)
    a = (torch.randn(r, 40, device=DEVICE) / 7).requires_grad_()
    b = (torch.randn(24, r, device=DEVICE) / 3).requires_grad_()
    return x, q, scale, a, b


@pytest.mark.parametrize("store", ["int8", "bf16"])
def test_opcheck_reference(store):
    x, q, scale, a, b = _op_inputs(store)
    torch.library.opcheck(frozen_linear._op, (x, q, scale, a, b, 2.0, "reference"))
    s = (x @ a.t()).detach()
    for need_dx in (True, False):
        torch.library.opcheck(frozen_linear._op_backward,
                              (torch.randn(20, 24), x.detach(), q, scale, a.detach(), b.detach(), s, 2.0,
                               "reference", need_dx))


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_opcheck_triton(triton_only, path):
    x, q, scale, a, b = _op_inputs("int8")
    torch.library.opcheck(frozen_linear._op, (x, q, scale, a, b, 2.0, path))
