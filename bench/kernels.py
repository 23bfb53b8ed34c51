"""Benchmark the frozen int8 + LoRA linear against its PyTorch baselines.

    python bench/kernels.py                               # LLaMA-350M and 1B layer shapes (GPU)
    python bench/kernels.py --quick                       # M=8192, r=16 only: < 2 min on an H200
    python bench/kernels.py --quick --out bench/kernels_gpu.md   # the table, rewritten after each shape

Providers, all with bf16 activations, timed forward, backward and forward+backward:
  step:<path>   our Triton op on the named path (* marks the one the dispatch picks: it times
                fused, hybrid and reference itself and prints its times first); the step:fused
                row lists the configs the autotuner chose for F2 and B3 (tiles, int8 conversion,
                warps and stages)
  reference     plain PyTorch (int8 -> bf16 cast, matmul, low-rank terms): STEP_KERNELS=reference
  bf16 frozen   F.linear with a frozen bf16 weight and no adapter: the speed ceiling
  bf16 trained  F.linear with a trained bf16 weight (dX and dW in the backward)

Without CUDA it checks the Triton paths against the reference in the Triton interpreter, then times
what a CPU run uses, forward + backward at step_small's layer shapes (with 350M's unless --quick), in
the CPU run's precision (bf16 autocast where the CPU computes bf16 natively, fp32 elsewhere: as
dtype=auto decides): the frozen linear's plain-PyTorch path with the int8 store and with a bf16
store, against nn.Linear's frozen and trained weights.
"""
import argparse
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported: Triton reads it then
os.environ.pop("STEP_LORA_PATH", None)    # the bench names each path itself
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT

import torch.nn.functional as F

import frozen_linear
from model import quantize_int8
from stepgpt import kernels
from stepgpt.kernels import frozen_lora

MODELS = {"350M": (1024, 2736), "1B": (2048, 5504)}        # hidden, FFN width, as config/step_*.py
TOKENS = (2048, 8192, 32768)
RANKS = (16, 64)
LORA_SCALE = 2.0
MODES = ("fwd", "bwd", "f+b")


def layer_shapes(d, ffn):
    # (layer, N, K) for y[M, N] = x[M, K] · Wᵀ
    return [("q/k/v/o", d, d), ("gate/up", ffn, d), ("down", d, ffn)]


def make_inputs(m, n, k, r):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    q, scale = quantize_int8(w)
    a = (torch.randn(r, k, device="cuda") / k ** 0.5).requires_grad_()   # fp32 masters
    b = (torch.randn(n, r, device="cuda") / r ** 0.5).requires_grad_()
    w_frozen = w.bfloat16()
    w_trained = w.bfloat16().requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return x, q, scale, a, b, w_frozen, w_trained, dy


def providers(inputs, paths):
    """-> [(name, fn, tensors with grads, GEMMs in the backward)]"""
    x, q, scale, a, b, w_frozen, w_trained, _ = inputs
    out = [(f"step:{p}", lambda p=p: frozen_linear.frozen_lora_linear(x, q, scale, a, b, LORA_SCALE, p),
            [x, a, b], 1) for p in paths]
    out.append(("reference",
                lambda: frozen_linear.frozen_lora_linear(x, q, scale, a, b, LORA_SCALE, "reference"),
                [x, a, b], 1))
    out.append(("bf16 frozen", lambda: F.linear(x, w_frozen), [x], 1))
    out.append(("bf16 trained", lambda: F.linear(x, w_trained), [x, w_trained], 2))
    return out


def do_bench(fn, grads):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, quantiles=[0.5, 0.2, 0.8])


def peak_mib(fn, dy, grads):
    # transient + saved memory of one forward+backward (the hybrid's shared scratch buffer, one
    # dequantised weight per device for all layers, already exists and is not counted)
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward(dy)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _config(c):
    tiles = "x".join(str(v) for k, v in c.kwargs.items() if k.startswith("BLOCK"))
    return f"{tiles} {c.kwargs.get('CONVERT', '')} {c.num_warps}w{c.num_stages}s"


def bench_config(model, layer, n, k, m, r, paths, reverse):
    inputs = make_inputs(m, n, k, r)
    dy = inputs[-1]
    provs = providers(inputs, paths)
    if reverse:  # alternate the provider order between configs against clock and thermal drift
        provs = provs[::-1]
    times = {name: {} for name, *_ in provs}
    for _, fn, _, _ in provs:  # compile and autotune outside the timed loops
        fn().backward(dy)
    for mode in MODES:
        for name, fn, grads, _ in provs:
            if mode == "fwd":
                times[name][mode] = do_bench(fn, grads)
            elif mode == "bwd":
                y = fn()
                times[name][mode] = do_bench(lambda y=y: y.backward(dy, retain_graph=True), grads)
                del y
            else:
                times[name][mode] = do_bench(lambda fn=fn: fn().backward(dy), grads)
    # the dispatch's own choice for this shape: it times the paths itself (and prints the times)
    x, q, scale, a, b = inputs[:5]
    auto = kernels.choose_path(x, q, scale, a, b, LORA_SCALE, (frozen_linear.forward, frozen_linear.backward))
    tuned = {name: frozen_lora.AUTOTUNED[name].best_config for name in ("_fwd_kernel", "_dx_kernel")}
    rows = []
    for name, fn, grads, bwd_gemms in sorted(provs, key=lambda p: p[0]):
        gemm = 2 * m * n * k
        t = times[name]
        rows.append(dict(model=model, layer=layer, n=n, k=k, m=m, r=r,
                         provider=name + ("*" if name == f"step:{auto}" or name == auto else ""),
                         configs=", ".join(f"{kernel[1:4]} {_config(c)}" for kernel, c in tuned.items())
                         if name == "step:fused" else "",
                         fwd=t["fwd"], bwd=t["bwd"], full=t["f+b"],
                         tflops_fwd=gemm / t["fwd"][0] * 1e-9,
                         tflops_full=gemm * (1 + bwd_gemms) / t["f+b"][0] * 1e-9,
                         peak=peak_mib(fn, dy, grads)))
    return rows


COLUMNS = [("model", 5, "{}"), ("layer", 8, "{}"), ("N", 5, "{}"), ("K", 5, "{}"), ("M", 6, "{}"),
           ("r", 3, "{}"), ("provider", 22, "{}"), ("fwd ms", 7, "{:.3f}"), ("bwd ms", 7, "{:.3f}"),
           ("f+b ms", 7, "{:.3f}"), ("f+b p20-p80", 13, "{}"), ("fwd TF/s", 8, "{:.0f}"),
           ("f+b TF/s", 8, "{:.0f}"), ("peak MiB", 8, "{:.0f}"), ("tuned configs", 44, "{}")]


def cells(row):
    full = row["full"]
    values = [row["model"], row["layer"], row["n"], row["k"], row["m"], row["r"], row["provider"],
              row["fwd"][0], row["bwd"][0], full[0], f"{full[1]:.3f}-{full[2]:.3f}",
              row["tflops_fwd"], row["tflops_full"], row["peak"], row["configs"]]
    return [fmt.format(v) for (_, _, fmt), v in zip(COLUMNS, values)]


def text_header():
    return "  ".join(f"{name:>{w}}" for name, w, _ in COLUMNS)


def text_rows(rows):
    return "\n".join("  ".join(f"{c:>{w}}" for c, (_, w, _) in zip(cells(row), COLUMNS)) for row in rows)


def markdown_table(rows):
    lines = ["| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def target_lines(rows):
    """Our goals at M=8192, r=16 (within 10 % of a bf16 frozen GEMM at 1B, 1.2-1.5x faster than the
    reference, the fused forward at 90 % of cuBLAS): for the path the dispatch picks (*) and,
    if another one is faster, for that one too."""
    lines = []

    def check(label, value, goal, ok):
        lines.append(f"{'PASS' if ok else 'FAIL'}  {label}: {value:.2f}x (goal {goal})")

    for model, (d, ffn) in MODELS.items():
        for layer, _, _ in layer_shapes(d, ffn):
            at = {row["provider"]: row for row in rows
                  if (row["model"], row["layer"], row["m"], row["r"]) == (model, layer, 8192, 16)}
            steps = [row for name, row in at.items() if name.startswith("step:")]
            if not steps:
                continue
            ref = next(row for name, row in at.items() if name.startswith("reference"))
            ceiling = at["bf16 frozen"]
            chosen = [row for row in steps if row["provider"].endswith("*")]   # none: the reference won
            fastest = min(steps, key=lambda row: row["full"][0])
            for row in chosen + ([] if fastest in chosen else [fastest]):
                where = f"{model} {layer} {row['provider']}"
                if model == "1B":
                    ratio = row["full"][0] / ceiling["full"][0]
                    check(f"{where} f+b time / bf16 frozen", ratio, "<= 1.10", ratio <= 1.10)
                speedup = ref["full"][0] / row["full"][0]
                goal = 1.2 if model == "1B" else 1.5
                check(f"{where} f+b speed-up over reference", speedup, f">= {goal}", speedup >= goal)
            fused = next(row for row in steps
                         if row["provider"].rstrip("*") == "step:fused")
            ratio = fused["tflops_fwd"] / ceiling["tflops_fwd"]
            check(f"{model} {layer} {fused['provider']} forward TFLOP/s / bf16 cuBLAS", ratio, ">= 0.90",
                  ratio >= 0.90)
    return lines


LEGEND = ("TFLOP/s counts the dense GEMMs only (2·M·N·K each: one forward; one backward, two for "
          "bf16 trained); medians of triton.testing.do_bench, p20-p80 for f+b. "
          "* = the path the dispatch picks for that shape (it may be the reference); tuned configs: "
          "the autotuner's F2 and B3 picks (tiles, int8 conversion, warps, stages).")


def write_markdown(path, header, rows, done, total):
    """The table so far, replacing the file whole: a run killed at a time limit leaves the shapes it
    finished."""
    partial = f"**Partial: {done} of {total} configurations measured.**\n\n" if done < total else ""
    with open(path + ".tmp", "w") as f:
        f.write(f"# bench/kernels.py\n\n{header}\n\n{partial}{LEGEND}\n\n{markdown_table(rows)}\n\n"
                "## Targets\n\n" + "\n".join(f"- {t}" for t in target_lines(rows)) + "\n")
    os.replace(path + ".tmp", path)


def run_gpu(args):
    import triton
    device = torch.cuda.get_device_name()
    header = (f"device {device} | torch {torch.__version__} | triton {triton.__version__} | "
              f"{'quick' if args.quick else 'full'} run | bf16 activations, LoRA scale {LORA_SCALE}")
    print(header)
    tokens, ranks = ((8192,), (16,)) if args.quick else (TOKENS, RANKS)
    todo = [(model, layer, n, k, m, r) for model, (d, ffn) in MODELS.items()
            for layer, n, k in layer_shapes(d, ffn) for m in tokens for r in ranks]
    rows = []
    print(text_header())
    for i, (model, layer, n, k, m, r) in enumerate(todo):
        new = bench_config(model, layer, n, k, m, r, list(frozen_lora.PATHS), reverse=i % 2 == 1)
        rows += new
        print(text_rows(new), flush=True)
        if args.out:
            write_markdown(args.out, header, rows, i + 1, len(todo))
    print("\n".join(["", "targets:"] + target_lines(rows)))
    if args.out:
        print(f"wrote {args.out}")


CPU_MODELS = {"step_small": (192, 512, 8), "350M": (1024, 2736, 64)}   # hidden, FFN, LoRA rank, as config/
CPU_TOKENS = 16 * 128    # step_small's micro-batch


def cpu_providers(m, n, k, r, bf16):
    """-> [(name, forward + backward, its GEMM FLOPs)] on the CPU, under bf16 autocast if `bf16` (fp32
    weights and inputs, as in training), for y[M, N] = x[M, K]·Wᵀ."""
    from torch.utils.benchmark import Timer
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k) / k ** 0.5
    q, scale = quantize_int8(w)
    a = (torch.randn(r, k) / k ** 0.5).requires_grad_()
    b = (torch.randn(n, r) / r ** 0.5).requires_grad_()
    trained, stored = w.clone().requires_grad_(), w.bfloat16()
    dy = torch.randn(m, n).to(torch.bfloat16 if bf16 else torch.float32)   # the outputs' dtype
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=bf16)
    lora = 4 * m * n * k + 6 * m * r * (k + n)   # x·Wᵀ and dY·W, and the adapter's six thin GEMMs

    def step(fn, grads):
        def run():
            for t in grads:
                t.grad = None
            with autocast:
                y = fn()
            y.backward(dy)
        return Timer("run()", globals={"run": run}).blocked_autorange(min_run_time=0.5).median
    return [("step int8 (reference)", step(lambda: frozen_linear.frozen_lora_linear(
                x, q, scale, a, b, LORA_SCALE, "reference"), [x, a, b]), lora),
            ("step bf16 store", step(lambda: frozen_linear.frozen_lora_linear(
                x, stored, None, a, b, LORA_SCALE, "reference"), [x, a, b]), lora),
            ("nn.Linear frozen", step(lambda: F.linear(x, w), [x]), 4 * m * n * k),
            ("nn.Linear trained", step(lambda: F.linear(x, trained), [x, trained]), 6 * m * n * k)]


def run_cpu_speed(quick, lines):
    """The table of cpu_providers at the shipped configs' layer shapes, appended to `lines`."""
    from stepgpt.runtime import native_bf16   # here, not above: it imports tiktoken, the GPU path does not
    native = native_bf16()   # what dtype=auto picks on this CPU
    precision = f"bf16 autocast ({native})" if native else "fp32 (no native bf16)"
    lines += [f"CPU, {precision}, {torch.get_num_threads()} threads, M = {CPU_TOKENS} tokens, "
              "forward + backward:",
              "| model | layer | N x K | r | provider | ms | GFLOP/s | vs nn.Linear trained |",
              "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines[-3:]), flush=True)
    for model, (d, ffn, r) in list(CPU_MODELS.items())[:1 if quick else None]:
        for layer, n, k in layer_shapes(d, ffn):
            rows = cpu_providers(CPU_TOKENS, n, k, r, bool(native))
            base = rows[-1][1]
            for name, seconds, flops in rows:
                lines.append(f"| {model} | {layer} | {n} x {k} | {r} | {name} | {seconds * 1e3:.3f} | "
                             f"{flops / seconds / 1e9:.1f} | {base / seconds:.2f}x |")
                print(lines[-1], flush=True)


def run_cpu_check(quick=False, out_file=None):
    """Every path against the reference on one ragged shape, in the Triton interpreter, then the
    CPU's own timings (run_cpu_speed); the lines also to `out_file`."""
    lines = ["no CUDA device: the Triton paths checked in the interpreter; the CPU's path timed after"]
    print(lines[0])
    if frozen_lora.INTERPRETER_PROBLEM:
        print(f"bench/kernels.py: {frozen_lora.INTERPRETER_PROBLEM}")
        return 1
    torch.manual_seed(0)
    m, n, k, r = 70, 45, 81, 16
    q, scale = quantize_int8(torch.randn(n, k))
    base = [torch.randn(m, k), torch.randn(r, k) / k ** 0.5, torch.randn(n, r) / r ** 0.5]
    dy = torch.randn(m, n)

    def run(fn):
        x, a, b = (t.clone().requires_grad_() for t in base)
        y = fn(x, q, scale, a, b, LORA_SCALE)
        y.backward(dy)
        return y.detach(), x.grad, a.grad, b.grad

    ref = run(lambda *args: frozen_linear.frozen_lora_linear(*args, path="reference"))
    ok = True
    for path in frozen_lora.PATHS:
        out = run(lambda *args, path=path: frozen_linear.frozen_lora_linear(*args, path=path))
        errs = [((u - v).abs().max() / v.abs().max()).item() for u, v in zip(out, ref)]
        good = all(e < 1e-4 for e in errs)
        ok &= good
        lines.append(f"{path:>16}: max rel err y {errs[0]:.1e}  dx {errs[1]:.1e}  dA {errs[2]:.1e}  "
                     f"dB {errs[3]:.1e}  {'ok' if good else 'MISMATCH'}")
        print(lines[-1])
    run_cpu_speed(quick, lines)
    if out_file:
        with open(out_file, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="M=8192, r=16 only (a CPU: step_small's)")
    parser.add_argument("--out", help="also write the results as markdown to this file")
    args = parser.parse_args()
    if not frozen_lora.HAS_TRITON:
        print("bench/kernels.py needs triton, which PyPI has for Linux only (pip install -r requirements.txt "
              "there); without it every frozen linear runs the plain-PyTorch reference")
        return 1
    if not HAS_CUDA:
        return run_cpu_check(args.quick, args.out)
    run_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
