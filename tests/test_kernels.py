"""The Triton kernels against their oracles: the frozen int8 + LoRA linear, forward and backward,
against float64 autograd on the same q and scale, and the dequantisation against PyTorch (exact).

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); with CUDA the same
tests compile them for real (fp32 as tf32, as train.py runs it), and the `gpu` tests add bf16 and
full autotuning. The `dispatch` fixture runs the fp32 tests twice on CPU: as the interpreter
dispatches, and taking CUDA's decisions (kernels._on_gpu patched: fp32 only with TF32 allowed).
"""
import functools
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import frozen_linear
from model import quantize_int8
from stepgpt import kernels
from stepgpt.kernels import frozen_lora
from tests.helpers import HANG, needs_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# max |out - oracle| / max |oracle|; fp32 dots on a GPU run as tf32 (10-bit mantissa)
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _clean_env(request, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("STEP_LORA_PATH", raising=False)
    # the path choice is its own test's business: here the paths are timed by a fixed table, never run
    monkeypatch.setattr(kernels, "CHOICES", {})
    fixed = {"fused": 1.0, "hybrid": 2.0, "reference": 3.0}
    monkeypatch.setattr(kernels, "_cuda_time", lambda path, fn: fixed[path])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True   # train.py's setting
        if request.node.get_closest_marker("gpu") is None:
            # with CUDA every test compiles for real; tuning every small shape would take many
            # minutes, so only the `gpu` tests run the full config sets
            for kernel in frozen_lora.AUTOTUNED.values():
                monkeypatch.setattr(kernel, "configs", kernel.configs[:1])
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32   # (monkeypatch cannot restore this attribute)


@pytest.fixture(params=["native", "cuda"])
def dispatch(request, monkeypatch):
    """On CPU, run a test as the interpreter dispatches and as CUDA would (the call taken for a GPU
    call, TF32 allowed as train.py allows it); with CUDA, as it is."""
    if request.param == "cuda" and DEVICE == "cpu":
        monkeypatch.setattr(kernels, "_on_gpu", lambda x: True)
        torch.backends.cuda.matmul.allow_tf32 = True   # _clean_env restores it
    elif request.param == "cuda":
        pytest.skip("on a GPU the native dispatch is CUDA's")
    return request.param


@pytest.fixture
def triton_only(monkeypatch):
    """Route the public API to Triton, make the references unreachable from it, and poison every
    buffer a kernel allocates so that an element it fails to write shows up as NaN (or -128)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    if kernels.INTERPRET:
        needs_interpreter()
    monkeypatch.setenv("STEP_KERNELS", "triton")

    def unreachable(*args, **kwargs):
        raise AssertionError("the reference ran although STEP_KERNELS=triton")

    empty = torch.empty

    def poisoned(*size, dtype=None, device=None, **kw):
        out = empty(*size, dtype=dtype, device=device, **kw)
        return out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(out.dtype).min)

    monkeypatch.setattr(frozen_linear, "forward", unreachable)
    monkeypatch.setattr(frozen_linear, "backward", unreachable)
    monkeypatch.setattr(frozen_linear, "weight", unreachable)
    monkeypatch.setattr(torch, "empty", poisoned)   # a correct kernel writes every element it allocates
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


@pytest.fixture(params=["direct", "fp32"])
def convert(request, monkeypatch):
    """The main GEMMs' two ways of turning the int8 tile into an MMA operand (the autotuner picks
    one per shape on a GPU): each test runs with both, in the first config of each list."""
    import triton
    for name in ("_fwd_kernel", "_dx_kernel"):
        kernel = frozen_lora.AUTOTUNED[name]
        first = kernel.configs[0]
        monkeypatch.setattr(kernel, "configs", [triton.Config(dict(first.kwargs, CONVERT=request.param),
                                                              num_warps=first.num_warps,
                                                              num_stages=first.num_stages)])
    return request.param


@pytest.mark.parametrize("path", frozen_lora.PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,n,k,r", SHAPES)
def test_frozen_lora_triton_matches_float64(triton_only, dispatch, convert, monkeypatch, lead, n, k, r, dtype,
                                            path):
    monkeypatch.setenv("STEP_LORA_PATH", path)
    _run_and_check(lead, n, k, r, dtype, strided=(r % 16 == 8))   # two of the four shapes strided


# 16- and 32-wide tiles put many tiles, GROUP_M groups and K-steps into a small problem
_TINY_CONFIGS = {
    "_fwd_kernel": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, CONVERT="direct"),
    "_dx_kernel": dict(BLOCK_M=32, BLOCK_K=16, BLOCK_N=16, GROUP_M=2, CONVERT="direct"),
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
    `order.seed` to choose the permutation (None: the interpreter's own sequential order)."""
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
def test_lora_backward_is_bit_identical_in_any_program_order_and_grid_size(triton_only, tiny_tiles,
                                                                            program_order, monkeypatch, path):
    # 10 row blocks in 3 slices: each slice's partial sums belong to it alone and are added up in a
    # fixed order, so neither the order the programs run in nor how many there are (a GPU's
    # multiprocessor count) changes a bit of dA or dB; each result is within tolerance of float64
    monkeypatch.setenv("STEP_LORA_PATH", path)
    monkeypatch.setattr(frozen_lora, "MAX_SLICES", 3)

    def grads(seed, programs):
        monkeypatch.setattr(frozen_lora, "CPU_PROGRAMS", programs)
        program_order.seed = seed
        torch.manual_seed(1)
        return _run_and_check((150,), 45, 70, 16, torch.float32)

    first = grads(None, 3)
    for seed, programs in ((1, 3), (2, 3), (3, 2), (4, 1)):
        assert all(torch.equal(u, v) for u, v in zip(first, grads(seed, programs)))


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


def test_static_rule_and_forced_paths(monkeypatch):
    assert kernels.static_path(kernels.HYBRID_MIN_TOKENS, 2048, 2048) == "hybrid"
    assert kernels.static_path(1024, 2048, 2048) == "fused"
    assert kernels.static_path(8192, 1024, 1024) == "fused"
    monkeypatch.setenv("STEP_KERNELS", "triton")
    x, q, scale, a, b = _op_inputs("int8")
    for forced in ("fused", "hybrid", "reference"):
        monkeypatch.setenv("STEP_LORA_PATH", forced)
        assert kernels.choose_path(x, q, scale, a, b, 2.0, None) == forced
    monkeypatch.setenv("STEP_LORA_PATH", "cublas")
    with pytest.raises(ValueError, match="STEP_LORA_PATH='cublas'"):
        kernels.choose_path(x, q, scale, a, b, 2.0, None)


def test_cuda_dispatch_sends_fp32_to_the_reference_unless_tf32_is_allowed(monkeypatch):
    monkeypatch.setenv("STEP_KERNELS", "triton")
    monkeypatch.setattr(kernels, "_on_gpu", lambda x: True)
    x, q, scale, a, b = _op_inputs("int8")
    torch.backends.cuda.matmul.allow_tf32 = False   # _clean_env restores it
    assert kernels.choose_path(x, q, scale, a, b, 2.0, None) == "reference"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert kernels.choose_path(x, q, scale, a, b, 2.0, None) != "reference"


def test_measured_dispatch_chooses_the_fastest_once_and_a_resume_reuses_it(triton_only, monkeypatch):
    """An injected timer stands in for CUDA events: the first training call of a shape times every
    path (without running it here), keeps the fastest, and later calls, inference included, reuse
    it; sampling-sized calls and unmeasured inference calls never time; state() and load_state()
    carry the choice into a resumed run."""
    timed = []
    fake = {"fused": 3e-3, "hybrid": 1e-3, "reference": 2e-3}
    monkeypatch.setattr(kernels, "_cuda_time", lambda path, fn: timed.append(path) or fake[path])
    monkeypatch.setattr(kernels, "_on_gpu", lambda x: True)   # only a GPU call is timed
    torch.backends.cuda.matmul.allow_tf32 = True             # as train.py sets it (_clean_env restores it)
    hybrid_runs = []
    scratch = frozen_lora._dequantize_to_scratch
    monkeypatch.setattr(frozen_lora, "_dequantize_to_scratch",
                        lambda *a: hybrid_runs.append(1) or scratch(*a))
    q, scale = quantize_int8(torch.randn(24, 40, device=DEVICE))
    a = torch.randn(8, 40, device=DEVICE).requires_grad_()
    b = torch.randn(24, 8, device=DEVICE).requires_grad_()

    def call(m, grad=True):
        x = torch.randn(m, 40, device=DEVICE, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            y = frozen_linear.frozen_lora_linear(x, q, scale, a, b, 2.0)
        if grad:
            y.sum().backward()

    call(300)
    assert sorted(timed) == ["fused", "hybrid", "reference"] and hybrid_runs
    assert kernels.CHOICES == {(512, 24, 40, 8, "float32"): "hybrid"}
    call(400)                           # the same bucket: no new timing
    call(500, grad=False)
    call(100)                           # at most DECODE_M tokens: fused, untimed
    call(2000, grad=False)              # inference of an unmeasured bucket: the static rule
    assert len(timed) == 3
    saved = json.loads(json.dumps(kernels.state()))
    monkeypatch.setattr(kernels, "CHOICES", {})
    kernels.load_state(saved)
    hybrid_runs.clear()
    call(300)
    assert len(timed) == 3 and hybrid_runs


def test_autotuner_choices_survive_a_resume(monkeypatch):
    kernel = frozen_lora.AUTOTUNED["_fwd_kernel"]
    monkeypatch.setattr(kernel, "configs", frozen_lora.CONFIGS["_fwd_kernel"])
    monkeypatch.setattr(kernel, "cache", {(512, 24, 40, 8, "torch.float32"): kernel.configs[3]})
    saved = json.loads(json.dumps(kernels.state()))
    monkeypatch.setattr(kernel, "cache", {})
    kernels.load_state(saved)
    assert kernel.cache == {(512, 24, 40, 8, "torch.float32"): frozen_lora.CONFIGS["_fwd_kernel"][3]}


@pytest.mark.slow
def test_under_ddp_rank_0s_measured_choice_holds_on_every_rank(tmp_path):
    """Two gloo ranks whose timers disagree: both keep rank 0's choice."""
    needs_interpreter()   # the ranks run on CPU, in the interpreter, with a GPU or without
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        import torch, torch.distributed as dist
        import frozen_linear
        from model import quantize_int8
        from stepgpt import kernels
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        fastest = "hybrid" if rank == 0 else "fused"
        kernels._cuda_time = lambda path, fn: 1.0 if path == fastest else 2.0
        q, scale = quantize_int8(torch.randn(24, 40))
        x, a, b = torch.randn(300, 40), torch.randn(8, 40), torch.randn(24, 8)
        choice = kernels.measure(x, q, scale, a, b, 2.0, (frozen_linear.forward, frozen_linear.backward))
        print(f"rank {{rank}}: {{choice}}", flush=True)
        dist.destroy_process_group()
    """))
    env = {**os.environ, "TRITON_INTERPRET": "1", "STEP_KERNELS": "triton"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], capture_output=True, text=True, timeout=HANG,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: hybrid" in proc.stdout and "rank 1: hybrid" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------
# devices and memory, CUDA's decisions on any machine: fake CUDA tensors on a second GPU

REAL_CUDA_TIME = kernels._cuda_time   # _clean_env replaces it with a fixed table
MIB = 2**20


@pytest.fixture
def second_gpu(monkeypatch):
    """Fake CUDA tensors (FakeTensorMode: shapes, dtypes and devices, no data) and torch.cuda's
    current device, events, synchronisation and peak statistics as recorders, device 0 current; every
    Triton kernel a recorder of the device current at its launch, which "allocates" 256 MiB there
    (the autotuner's L2-flush buffer; training's own peak so far is 100 MiB, 40 MiB live). ->
    (the fake mode, what was recorded: launches and events as (name, current device, the tensors'
    devices), the allocator's state)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    from torch._subclasses.fake_tensor import FakeTensorMode
    seen = {"launches": [], "events": [], "current": [0], "peak": 100 * MIB, "live": 40 * MIB, "resets": []}

    class Device:   # torch.cuda.device(d): d current inside
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            seen["current"].append(self.index)

        def __exit__(self, *exc):
            seen["current"].pop()

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            seen["events"].append(("event", seen["current"][-1], None))

        def elapsed_time(self, end):
            return 1.0

    class Kernel:   # kernel[grid](*args): a launch
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                devices = {a.device.index for a in args if torch.is_tensor(a)}
                seen["launches"].append((self.name, seen["current"][-1], devices))
                seen["peak"] = max(seen["peak"], seen["live"] + 256 * MIB)
            return launch

    def reset(device):
        seen["resets"].append(torch.device(device).index)
        seen["peak"] = seen["live"]

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: seen["current"][-1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    sm = SimpleNamespace(multi_processor_count=4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: sm)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: seen["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    for name in ("_lora_down_kernel", "_fwd_kernel", "_lora_bwd_kernel", "_dx_kernel", "_dequantize_kernel"):
        monkeypatch.setattr(frozen_lora, name, Kernel(name))
    monkeypatch.setattr(frozen_lora, "_SCRATCH", {})   # it would keep a fake buffer
    monkeypatch.setattr(kernels, "PEAK_BEFORE", {})
    return FakeTensorMode(), seen


def _layer_on(device, m=300, n=24, k=40, r=8):
    """-> x [M, K], q [N, K] int8, scale [N], A [r, K], B [N, r] on `device`."""
    empty = functools.partial(torch.empty, device=device)
    return empty(m, k), empty(n, k, dtype=torch.int8), empty(n), empty(r, k), empty(n, r)


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_the_launchers_launch_on_the_tensors_device_not_the_current_one(second_gpu, path):
    """Triton launches on the current CUDA device: the launchers (which the frozen linear's custom
    op calls) make the tensors' own device current first, here cuda:1 with cuda:0 current (as
    bench/step_time.py --set device=cuda:1 runs, which sets no device)."""
    mode, seen = second_gpu
    with mode:
        x, q, scale, a, b = _layer_on("cuda:1")
        y, s = frozen_lora.forward(path, x, q, scale, a, b, 2.0)
        frozen_lora.backward(path, torch.empty_like(y), x, q, scale, a, b, s, 2.0, True)
    names = {name for name, _, _ in seen["launches"]}
    assert names == {"_lora_down_kernel", "_lora_bwd_kernel"} | (
        {"_dequantize_kernel"} if path == "hybrid" else {"_fwd_kernel", "_dx_kernel"})
    assert all(current == 1 and devices == {1} for _, current, devices in seen["launches"]), seen["launches"]
    assert seen["current"] == [0]   # and device 0 current again after


def test_the_kernels_measurement_is_timed_on_the_tensors_device_and_left_out_of_the_peak(second_gpu):
    """kernels.measure() times every path by CUDA events on the tensors' device (cuda:1), and the
    memory it allocates there (the autotuner's 256 MiB flush buffer; vanilla runs never measure) is
    no part of the peak a run reports: training's 100 MiB before it, the peak since after it."""
    from stepgpt import monitor
    mode, seen = second_gpu
    kernels._cuda_time = REAL_CUDA_TIME   # the events, not _clean_env's table (monkeypatch restores it)
    # the reference's shapes alone (its math indexes in ways fake CUDA tensors cannot on a CPU build)
    reference = (lambda x, q, scale, a, b, s: (x.new_empty(len(x), len(q)), x.new_empty(len(x), len(a))),
                 lambda *args: (None, None, None))
    with mode:
        x, q, scale, a, b = _layer_on("cuda:1")
        kernels.measure(x, q, scale, a, b, 2.0, reference)
    assert seen["launches"] and all(current == 1 for _, current, _ in seen["launches"])
    assert seen["events"] and all(current == 1 for _, current, _ in seen["events"])
    assert seen["resets"] == [1]
    device = torch.device("cuda:1")
    assert kernels.training_peak(device) == 100 * MIB          # not 40 + 256 MiB
    lines = []   # the run's last line
    run = SimpleNamespace(device=device, total_iters=10, tokens_per_iter=64,
                          log=SimpleNamespace(print=lines.append))
    monitor.Meter(run, 0).done(best_val=1.0)
    assert lines[-1].endswith("peak cuda 100.0MiB")
    seen["peak"] = 150 * MIB   # training goes on above its old peak
    assert kernels.training_peak("cuda:1") == 150 * MIB
    kernels.reset_peak(device)   # bench/peak_memory.py's windows
    assert kernels.training_peak(device) == seen["live"] and seen["resets"] == [1, 1]


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
def test_frozen_lora_cuda_bf16(triton_only, convert, monkeypatch, lead, n, k, r, path):
    for kernel in frozen_lora.AUTOTUNED.values():  # ragged shapes, first configs; tuning is the next test's
        monkeypatch.setattr(kernel, "configs", kernel.configs[:1])
    monkeypatch.setenv("STEP_LORA_PATH", path)
    _run_and_check(lead, n, k, r, torch.bfloat16, strided=(r % 16 == 8))


@_gpu
@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_frozen_lora_cuda_autotuned_and_bit_identical_when_repeated(triton_only, monkeypatch, path):
    assert len(frozen_lora._fwd_kernel.configs) > 1, "with CUDA the full config sets are tuned"
    monkeypatch.setenv("STEP_LORA_PATH", path)
    torch.manual_seed(1)
    first = _run_and_check((4, 600), 1024, 768, 16, torch.bfloat16)
    torch.manual_seed(1)
    second = _run_and_check((4, 600), 1024, 768, 16, torch.bfloat16)
    assert all(torch.equal(u, v) for u, v in zip(first, second))   # no atomics anywhere


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
                              (torch.randn(20, 24, device=DEVICE), x.detach(), q, scale, a.detach(),
                               b.detach(), s, 2.0,
                               "reference", need_dx))


@pytest.mark.parametrize("path", frozen_lora.PATHS)
def test_opcheck_triton(triton_only, path):
    x, q, scale, a, b = _op_inputs("int8")
    torch.library.opcheck(frozen_linear._op, (x, q, scale, a, b, 2.0, path))


@pytest.mark.slow
def test_a_run_tunes_each_kernel_once_per_shape_however_many_tokens_it_samples(tmp_path, monkeypatch):
    """The README main command's code path, scaled down in size: training steps, eval and a sample
    through the Triton kernels (the interpreter standing in for the GPU), with the full config
    lists and a counting timer in place of the GPU benchmarks. The autotune keys bucket the tokens:
    training and eval share one bucket, and sampling's calls (1 to 32 tokens here: 40 tokens run past
    the context, as the main command's 200 run past its 128) take the first
    config untuned, so each kernel is tuned once per layer shape. A tuning is a benchmark among more
    than one config: triton 3.6 and 3.7 also benchmark the one config a sampling key is left with
    (3.8 and later do not), which chooses nothing and is not counted."""
    if not kernels.INTERPRET:
        pytest.skip("emulates a GPU run in the Triton interpreter, with a counting timer")
    needs_interpreter()
    import train
    from tests.helpers import write_dataset
    monkeypatch.setenv("STEP_KERNELS", "triton")
    benchmarked = {name: 0 for name in frozen_lora.AUTOTUNED}
    choices = {}   # kernel -> how many configs its last pruning left to benchmark

    def counting(name):
        def bench(kernel_call, quantiles):
            benchmarked[name] += choices[name] > 1
            return [1.0, 1.0, 1.0]
        return bench

    def pruning(name, prune):
        def prune_configs(kwargs):
            pruned = prune(kwargs)
            choices[name] = len(pruned)
            return pruned
        return prune_configs

    for name, kernel in frozen_lora.AUTOTUNED.items():
        monkeypatch.setattr(kernel, "configs", frozen_lora.CONFIGS[name])
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.setitem(kernel.__dict__, "do_bench", counting(name))   # over the cached_property
        monkeypatch.setattr(kernel, "prune_configs", pruning(name, kernel.prune_configs))
    data = write_dataset(tmp_path / "data", vocab=300)    # 299 BPE ranks + <|endoftext|>: a real tokenizer
    train.main(["--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--lora_rank=8", "--block_size=32",
                "--batch_size=8", "--stage_layers=[1, 1]", "--max_iters=4", "--eval_interval=2",
                "--eval_iters=1", "--warmup_iters=1", "--stage_warmup_iters=1", "--log_interval=1",
                "--sample_tokens=40",
                "--device=cpu", f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert (tmp_path / "out" / "sample.txt").exists()
    # one bucket (8 x 32 = 256 tokens); F1's key has no N: its two shapes are K = 32 and 64
    configs = {name: len(frozen_lora.CONFIGS[name]) for name in frozen_lora.AUTOTUNED}
    assert benchmarked == {"_lora_down_kernel": 2 * configs["_lora_down_kernel"],
                           "_fwd_kernel": 3 * configs["_fwd_kernel"],
                           "_lora_bwd_kernel": 3 * configs["_lora_bwd_kernel"],
                           "_dx_kernel": 3 * configs["_dx_kernel"]}
