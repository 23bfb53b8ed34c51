"""Where the frozen linear runs: the plain-PyTorch math of frozen_linear.py ("reference"), or the
Triton kernels of frozen_lora.py on one of their two paths ("fused": the int8 weight dequantised in
the GEMMs' registers; "hybrid": dequantised into a scratch buffer for cuBLAS). Decided per call:

  STEP_KERNELS=auto       (default) CUDA tensors may run Triton; CPU tensors run the reference,
                          except under TRITON_INTERPRET=1, where they run Triton's interpreter.
  STEP_KERNELS=reference  always the reference (for A/B comparisons and debugging).
  STEP_KERNELS=triton     Triton wherever it can run (a CPU tensor then needs TRITON_INTERPRET=1).
  STEP_LORA_PATH=fused|hybrid|reference forces the path of a call that may run Triton.

A call that may run Triton picks its path by measurement: on CUDA, the first training call of each
(token bucket, N, K, r, dtype) times fused, hybrid and the reference, forward and backward, on the
layer's own weights, keeps the fastest and prints the times; under DDP rank 0's choice holds on
every rank. train.py measures each new layer shape before torch.compile traces the model, keeps the
choices (and the autotuner's) in the run folder, and loads them on resume, so a resumed run computes
the same way. Where nothing can be timed (the interpreter, a graph being traced, an inference call
that was never measured) the static rule static_path() picks. Calls of at most DECODE_M tokens
(sampling) take the fused path untuned: it reads the int8 weight once.

This package is not a top-level `kernels/`: Hugging Face's package of that name (a dependency of
transformers) would be shadowed by it wherever the repository is on the path.
"""
import os
import statistics

import torch
import torch.distributed as dist

from stepgpt.kernels import frozen_lora
from stepgpt.kernels.frozen_lora import DECODE_M, HAS_TRITON, INTERPRET, PATHS, backward, forward, m_bucket

__all__ = ["DECODE_M", "HAS_TRITON", "INTERPRET", "PATHS", "backward", "choose_path", "compute_dtype",
           "forward", "load_state", "measure", "measure_layers", "reset_peak", "state", "static_path",
           "training_peak", "use_triton"]

CHOICES = {}    # (token bucket, N, K, r, dtype) -> the measured path


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


# The static rule, for calls nothing could time. Dequantising to scratch costs ~1.5·(F/BW)/M of the
# GEMM (F/BW ≈ 165 FLOP/B on an H200: 12% at M=2k, 3% at 8k); the hybrid path wins where the fused
# main loop runs below that fraction of cuBLAS's speed, at large M and large weights.
HYBRID_MIN_TOKENS = 2048
HYBRID_MIN_WEIGHT = 2048 * 2048


def static_path(m, n, k):
    return "hybrid" if m >= HYBRID_MIN_TOKENS and n * k >= HYBRID_MIN_WEIGHT else "fused"


def choose_path(x, q, scale, a, b, s, reference):
    """"reference" or a Triton path for x [..., K] through the frozen weight q [N, K] with the
    adapter A [r, K], B [N, r] and scale s. `reference`: frozen_linear's (forward, backward)."""
    assert x.shape[-1] == q.shape[1], f"x has K={x.shape[-1]} but the weight has K={q.shape[1]}"
    # a bf16 store is a plain GEMM, which cuBLAS does best; without adapters (rank 0) there is
    # nothing to fuse; fp32 activations where torch forbids TF32 would make the kernels' dots plain
    # FMA, far slower than cuBLAS in fp32: all three take the reference path. On CPU tensors the
    # interpreter runs the kernels in any dtype.
    on_gpu = _on_gpu(x)
    fp32_ok = x.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 or (INTERPRET and not on_gpu)
    if not (use_triton(x) and q.dtype == torch.int8 and a.shape[0] > 0 and fp32_ok):
        return "reference"
    forced = os.environ.get("STEP_LORA_PATH", "auto")
    if forced != "auto":
        if forced not in PATHS + ("reference",):
            raise ValueError(f"STEP_LORA_PATH={forced!r} is not one of auto, {', '.join(PATHS)}, reference")
        return forced
    n, k = q.shape
    m = x.numel() // k
    key = _key(m, n, k, a.shape[0], x.dtype)
    if key[0] == 0:
        return "fused"
    if key not in CHOICES and on_gpu and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        measure(x, q, scale, a, b, s, reference)
    return CHOICES.get(key) or static_path(m, n, k)


def _on_gpu(x):
    """Whether a call runs on the GPU: only there are the paths timed and fp32 held to TF32."""
    return x.is_cuda


def _key(m, n, k, r, dtype):
    return m_bucket(m), n, k, r, str(dtype).removeprefix("torch.")


def measure(x, q, scale, a, b, s, reference):
    """Time one forward and backward of every path on these tensors (x: any values of the right
    shape and dtype), keep the fastest as the choice for their key, print the times. Collective
    under DDP: every rank calls it, rank 0's choice holds."""
    k = q.shape[1]
    x = x.detach().reshape(-1, k)
    key = _key(x.shape[0], q.shape[0], k, a.shape[0], x.dtype)
    peak = torch.cuda.max_memory_allocated(x.device) if x.is_cuda else 0   # training's, until now
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False), frozen_lora.on_device(x.device):
        dy = torch.randn(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device)
        impl = {p: (forward, backward) for p in PATHS}
        impl["reference"] = reference

        def run(path):
            fwd, bwd = impl[path]
            args = (path,) if path != "reference" else ()
            _, xa = fwd(*args, x, q, scale, a, b, s)
            bwd(*args, dy, x, q, scale, a, b, xa, s, True)

        times = {path: _cuda_time(path, lambda path=path: run(path)) for path in impl}
    if x.is_cuda:   # what the timing allocated is no part of training's peak (training_peak)
        torch.cuda.reset_peak_memory_stats(x.device)
        PEAK_BEFORE[x.device] = max(PEAK_BEFORE.get(x.device, 0), peak)
    choice = [min(times, key=times.get)]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    CHOICES[key] = choice[0]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"kernels: M~{key[0]} x {k} -> {key[1]}, r={key[3]}, {key[4]}: "
              + ", ".join(f"{p} {1000 * t:.3f} ms" for p, t in times.items()) + f" -> {choice[0]}",
              flush=True)
    return choice[0]


# measure() allocates what training never does (Triton's autotuner flushes the L2 cache with a
# 256 MB buffer; every path's temporaries), which vanilla runs never measure: it resets CUDA's peak
# statistic when it is done and keeps the peak before it here, so a run reports training's peak.
PEAK_BEFORE = {}   # CUDA device -> the peak allocated before the last measurement on it


def training_peak(device):
    """torch.cuda.max_memory_allocated(device) of training alone: the kernels' measurements left out."""
    return max(PEAK_BEFORE.get(_cuda(device), 0), torch.cuda.max_memory_allocated(device))


def reset_peak(device):
    """torch.cuda.reset_peak_memory_stats(device), and the peak kept from before a measurement too."""
    torch.cuda.reset_peak_memory_stats(device)
    PEAK_BEFORE.pop(_cuda(device), None)


def _cuda(device):   # "cuda" -> "cuda:N", the current device: a tensor's own name for it
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _cuda_time(path, fn, reps=5):
    """Seconds of one call of fn (the median of `reps`, after two warm-up calls), by CUDA events."""
    fn()   # the first call compiles and autotunes
    fn()
    ends = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in ends:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in ends) / 1000


def measure_layers(model, tokens, dtype, reference):
    """Measure, where not yet measured, the path of each frozen linear of `model` (the modules with
    an int8 weight_q) for a training call of `tokens` tokens in `dtype`, on its own weights;
    collective under DDP. train.py calls it before torch.compile traces the model, which then
    reads the choices. `reference`: frozen_linear's (forward, backward)."""
    for m in model.modules():
        if not hasattr(m, "weight_q") or not _on_gpu(m.weight_q):   # only a GPU call is timed
            continue
        x = torch.randn(tokens, m.in_features, dtype=dtype, device=m.weight_q.device)
        with torch.enable_grad():   # as a training call: measured if it may run Triton
            choose_path(x, m.weight_q, m.weight_scale, m.lora_a, m.lora_b, m.lora_scale, reference)


def state():
    """The measured paths and the autotuner's choices, as JSON-able data (kept in a run folder)."""
    configs = {name: [[list(key), cfg.all_kwargs()] for key, cfg in kernel.cache.items()]
               for name, kernel in frozen_lora.AUTOTUNED.items()}
    return {"paths": [[*key, path] for key, path in CHOICES.items()], "configs": configs}


def load_state(saved):
    """Take the choices of state() back: the same paths and kernel configs as the run that saved them."""
    CHOICES.update({tuple(entry[:-1]): entry[-1] for entry in saved.get("paths", [])})
    for name, kernel in frozen_lora.AUTOTUNED.items():
        for key, kwargs in saved.get("configs", {}).get(name, []):
            match = [c for c in kernel.configs if c.all_kwargs() == kwargs]
            if match:
                kernel.cache[tuple(key)] = match[0]
