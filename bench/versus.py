"""Training throughput of our model (vanilla and each STEP stage) against nanoGPT's and Hugging Face's
LlamaForCausalLM at the same shape, in each mode (eager or compiled, fp32 or bf16), in one run.

    python bench/versus.py --nanogpt ../nanoGPT        # step_small's shape, the four modes, this machine
    python bench/versus.py --quick                     # tiny and eager fp32 only (the tests' form)
    python bench/versus.py --nanogpt ../nanoGPT --modes eager-fp32,eager-bf16 --out versus.md

The rows, all at the config's shape (default config/step_small.py: 6 layers, n_embd 192, 6 heads,
ffn_hidden 512, the data's vocabulary as bench/step_time.py takes it, batch 16 x block 128):
- ours vanilla: every parameter trained (the final depth);
- ours STEP k/K: the model of the config's plan at stage k (grow.plan_stages over the final depth,
  as bench/step_time.py scales it), its earlier stages' layers frozen (int8 + LoRA); the last stage
  is step_time's "STEP, n of m frozen";
- nanoGPT: GPT(GPTConfig(n_layer, n_head, n_embd, block_size, vocab_size, bias=False, dropout=0))
  from model.py of the local checkout `--nanogpt PATH` names (read from there with importlib,
  nothing of it is copied here); without one its rows are skipped with one line;
- HF Llama: transformers' LlamaForCausalLM (hidden_size=n_embd, intermediate_size=ffn_hidden, the
  layers, heads, vocabulary, rope theta, norm eps and embedding tying of ours, sdpa attention);
  without transformers its rows are skipped with one line.

A step is forward with the loss (ours with the config's loss_chunk, as train.py runs it), backward
and the optimizer step: ours train.configure_optimizer's
(the config's optimizer; step_small: AdamW), the others torch.optim.AdamW over all their parameters
(fused on CUDA, as ours). Modes: eager or torch.compile(model) (its compilation is the first warm-up
step, reported as "compile s" and left out of the timing; on a CPU only with a C++ compiler, else
skipped with one line), in fp32 (TF32 matmuls allowed on CUDA, as train.py) or bf16 autocast. Each
mode builds its models afresh and times them in alternating windows (bench/step_time.py's
helpers), so that a change in the machine's speed hits all of them; the result is the median window.

FLOPs: training matmul FLOPs per token, counted from each model's weights: 6 per trained matmul
weight (forward, input gradient, weight gradient), 4 per frozen one (no weight gradient), the
embedding lookup none, plus the attention scores and mixing, 12 x layers x n_embd x block (PaLM's,
causal mask not credited; nanoGPT's estimate_mfu counts the same, with its embedding as the head).
Ours from model.estimate_flops, the others from their nn.Linear weights. A layer of nanoGPT has
12 n_embd^2 such weights (qkv, proj, a 4 x n_embd GELU MLP), one of ours and of Llama 4 n_embd^2 +
3 n_embd ffn_hidden (SwiGLU): equal when 3 ffn_hidden = 8 n_embd, as at step_small (3 x 512 = 8 x
192); at other shapes a line says they differ, and TFLOP/s is the figure to compare. nanoGPT always
ties its head to its embedding (fewer parameters, the same matmuls). MFU is the achieved FLOP/s over
the machine's GEMM peak in the mode's dtype, measured at the start (a square matmul, 2048 on a CPU,
8192 on CUDA, in its faster layout, the fastest of a few repeats).
"""
import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
import frozen_linear
import grow
from bench.step_time import build, step
from data.load import planned_vocab
from stepgpt import kernels, runtime
from stepgpt.config import load_config

MODES = ("eager-fp32", "compiled-fp32", "eager-bf16", "compiled-bf16")
QUICK = dict(layers=2, batch=2, block=32, windows=1, steps=1, warmup=1, modes="eager-fp32", gemm=512)


def linear_flops(model, n_layer, n_embd, block):
    """Training matmul FLOPs per token from a model's nn.Linear weights (6 per trained weight, 4 per
    frozen one) plus attention's 12 x layers x n_embd x block: model.estimate_flops's count."""
    weights = sum((6 if m.weight.requires_grad else 4) * m.weight.numel()
                  for m in model.modules() if isinstance(m, nn.Linear))
    return weights + 12 * n_layer * n_embd * block


def load_nanogpt(path):
    """-> (nanoGPT's model module, None), or (None, why its rows are skipped). `path`: a checkout of
    karpathy/nanoGPT (or its model.py), loaded where it is under a name of its own."""
    if not path:
        return None, "no --nanogpt PATH (a local checkout of karpathy/nanoGPT, holding its model.py)"
    file = os.path.join(path, "model.py") if os.path.isdir(path) else path
    if not os.path.isfile(file) or os.path.basename(file) != "model.py":
        return None, f"--nanogpt {path}: no model.py there"
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclass looks its module up
    spec.loader.exec_module(module)
    if not (hasattr(module, "GPT") and hasattr(module, "GPTConfig")):
        return None, f"{file} defines no GPT and GPTConfig (not nanoGPT's model.py?)"
    return module, None


class HFLoss(nn.Module):
    """A Hugging Face causal LM called as ours and nanoGPT's are: (idx, targets) -> (None, loss).
    Its loss shifts the labels itself (T - 1 predictions a row; the logits of all T are computed)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return None, self.model(input_ids=idx, labels=targets, use_cache=False).loss


def hf_llama(tcfg, n_layer, vocab, block):
    from transformers import LlamaConfig, LlamaForCausalLM
    theta = tcfg.rope_theta   # transformers 5 takes it in rope_parameters, 4 as rope_theta
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
            if "rope_parameters" in LlamaConfig.__init__.__code__.co_varnames else {"rope_theta": theta})
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=tcfg.n_embd, intermediate_size=tcfg.ffn_hidden,
                      num_hidden_layers=n_layer, num_attention_heads=tcfg.n_head,
                      num_key_value_heads=tcfg.n_head, max_position_embeddings=block,
                      rms_norm_eps=tcfg.norm_eps, tie_word_embeddings=tcfg.tie_embeddings, use_cache=False,
                      attention_dropout=0.0, attn_implementation="sdpa", **rope)
    return HFLoss(LlamaForCausalLM(cfg))


def adamw(model, tcfg, device):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tcfg.learning_rate,
                             betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay,
                             fused=device.type == "cuda")


def rows(tcfg, plan, n_layer, vocab, block, device, nanogpt, hf):
    """-> [(name, build function -> (model, optimizer, FLOPs per token, forward's keywords))] of one
    mode's models."""
    def ours(n, frozen):
        def make():
            model, opt = build(tcfg, n, frozen, vocab, block, device)
            return model, opt, model.estimate_flops(), dict(loss_chunk=tcfg.loss_chunk)   # as train.py
        return make

    def other(make_model, depth):
        def make():
            torch.manual_seed(0)
            with contextlib.redirect_stdout(io.StringIO()):   # nanoGPT prints its parameter count
                model = make_model().to(device)
            return model, adamw(model, tcfg, device), linear_flops(model, depth, tcfg.n_embd, block), {}
        return make

    out = [("ours vanilla", ours(n_layer, 0))]
    for k in range(len(plan)):
        depth, frozen = sum(plan[:k + 1]), sum(plan[:k])
        out.append((f"ours STEP {k + 1}/{len(plan)}, {depth} layer{'s' if depth > 1 else ''}"
                    + (f", {frozen} frozen" if frozen else ""), ours(depth, frozen)))
    if nanogpt:
        cfg = dict(n_layer=n_layer, n_head=tcfg.n_head, n_embd=tcfg.n_embd, block_size=block,
                   vocab_size=vocab, bias=False, dropout=0.0)
        out.append(("nanoGPT", other(lambda: nanogpt.GPT(nanogpt.GPTConfig(**cfg)), n_layer)))
    if hf:
        out.append(("HF Llama", other(lambda: hf_llama(tcfg, n_layer, vocab, block), n_layer)))
    return out


def gemm_peak(device, dtype, n, sync, seconds=0.3):
    """FLOP/s of the fastest n x n x n matmul in `dtype`, repeated for `seconds` (3 times at least),
    in the faster layout at n / 4 of A @ B and A @ B^T (nn.Linear's: on a CPU without native bf16 it
    is several times faster in bf16)."""
    def best(a, b, seconds):
        a @ b
        sync()
        fastest, start = float("inf"), time.perf_counter()
        for i in range(1000):
            t0 = time.perf_counter()
            a @ b
            sync()
            fastest = min(fastest, time.perf_counter() - t0)
            if i >= 2 and time.perf_counter() - start > seconds:
                return fastest

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    pa, pb = a[: n // 4 or 1, : n // 4 or 1].contiguous(), b[: n // 4 or 1, : n // 4 or 1].contiguous()
    transposed = best(pa, pb.t(), 0) <= best(pa, pb, 0)
    return 2 * n ** 3 / best(a, b.t() if transposed else b, seconds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="config/step_small.py")
    p.add_argument("--nanogpt", help="a local checkout of karpathy/nanoGPT: its model.py is loaded there")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    p.add_argument("--device", default="auto", help="auto (CUDA where there is one), cpu, cuda or cuda:N")
    p.add_argument("--layers", type=int, help="final depth (default: the config's)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the config's batch_size)")
    p.add_argument("--block", type=int, help="tokens per sequence (default: the config's block_size)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (default: the config's data)")
    p.add_argument("--windows", type=int, help="timing windows (default 5)")
    p.add_argument("--steps", type=int, help="steps per window (default 2)")
    p.add_argument("--warmup", type=int, help="warm-up steps, at least 1 when compiled (default 2)")
    p.add_argument("--gemm", type=int, help="the peak's square matmul (default 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--quick", action="store_true",
                   help="tiny: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()) + " (unless given)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override, as on the train.py command line (repeatable)")
    p.add_argument("--out", help="also write the table to this file, after each window (a run stopped at a "
                                 "time limit leaves the windows it finished)")
    args = p.parse_args(argv)
    device = torch.device(runtime.pick_device(args.device, 0, False))
    defaults = dict(QUICK) if args.quick else dict(windows=5, steps=2, warmup=2, modes=",".join(MODES),
                                                   gemm=8192 if device.type == "cuda" else 2048)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)

    tcfg = load_config([args.config] + [f"--{s}" for s in args.set])
    n_layer = args.layers or grow.final_depth(tcfg)
    vocab = args.vocab or planned_vocab(tcfg.data_dir, tcfg.vocab_size)[0]
    batch, block = args.batch or tcfg.batch_size, args.block or tcfg.block_size
    plan = grow.plan_stages(grow.model_config(tcfg, n_layer, vocab), n_layer, grow.stage_count(tcfg))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if [m for m in modes if m not in MODES] or not modes:
        sys.exit(f"bench/versus.py: --modes {args.modes}: use some of {', '.join(MODES)}")
    notes = []
    if device.type != "cuda" and [m for m in modes if m.startswith("compiled")]:
        why = ("torch.compile is not used on MPS (as train.py)" if device.type == "mps" else
               None if runtime.has_cpp_compiler() else
               "torch.compile needs a C++ compiler on the CPU (g++, clang++ or $CXX) and none was found")
        if why:
            notes.append(f"compiled modes skipped: {why}")
            modes = [m for m in modes if not m.startswith("compiled")]
    nanogpt, why = load_nanogpt(args.nanogpt)
    if why:
        notes.append(f"nanoGPT rows skipped: {why}")
    hf = importlib.util.find_spec("transformers") is not None
    if not hf:
        notes.append("HF Llama rows skipped: transformers is not installed (pip install transformers)")
    c, f = tcfg.n_embd, tcfg.ffn_hidden
    if nanogpt and 3 * f != 8 * c:
        notes.append(f"nanoGPT's layers hold {12 * c * c:,} matmul weights (4 x n_embd GELU MLP), ours and "
                     f"Llama's {4 * c * c + 3 * c * f:,} (SwiGLU, ffn {f}): FLOPs differ, compare TFLOP/s")
    for line in notes:
        print(line, flush=True)

    torch.backends.cuda.matmul.allow_tf32 = True   # as runtime.precision sets it for train.py's runs
    torch.backends.cudnn.allow_tf32 = True
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dtypes = sorted({m.split("-")[1] for m in modes})
    peaks = {d: gemm_peak(device, torch.float32 if d == "fp32" else torch.bfloat16, args.gemm, sync)
             for d in dtypes}
    about = [f"{args.config}: {n_layer} layers (STEP plan {'+'.join(map(str, plan))}), n_embd {c}, "
             f"{tcfg.n_head} heads, ffn {f}, lora rank {tcfg.lora_rank}, vocab {vocab}; "
             f"batch {batch} x {block} tokens; {device.type}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; "
             f"{args.windows} windows of {args.steps} steps after {args.warmup} warm-up",
             f"GEMM peak ({args.gemm}^3 matmul): "
             + ", ".join(f"{d} {peaks[d] / 1e12:.4g} TFLOP/s" for d in dtypes)
             + (" (fp32 with TF32 allowed)" if device.type == "cuda" and "fp32" in dtypes else "")]

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, block), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, block), generator=g).to(device)
    done = []
    for mode in modes:
        compiled, bf16 = mode.startswith("compiled"), mode.endswith("bf16")
        dtype = torch.bfloat16 if bf16 else torch.float32
        autocast = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
        runs = []
        for name, make in rows(tcfg, plan, n_layer, vocab, block, device, nanogpt, hf):
            model, opt, flops, kw = make()
            kernels.measure_layers(model, batch * block, dtype,
                                   (frozen_linear.forward, frozen_linear.backward))
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            frozen = model.num_params()[1] if hasattr(model, "num_params") else 0
            runs.append(dict(name=name, mode=mode, model=model, opt=opt, flops=flops, trained=trained,
                             frozen=frozen, fn=torch.compile(model) if compiled else model, kw=kw, times=[],
                             compile_s=None))
        for run in runs:
            for i in range(max(args.warmup, 1 if compiled else 0)):
                sync()
                t0 = time.perf_counter()
                step(run["fn"], run["opt"], x, y, autocast, **run["kw"])
                sync()
                if compiled and i == 0:
                    run["compile_s"] = time.perf_counter() - t0
        for w in range(args.windows):
            for run in (runs if w % 2 == 0 else runs[::-1]):   # alternate who goes first
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(run["fn"], run["opt"], x, y, autocast, **run["kw"])
                sync()
                run["times"].append((time.perf_counter() - t0) / args.steps)
            if args.out:
                last = mode == modes[-1] and w + 1 == args.windows
                partial = [] if last else [f"(partial: {mode}, {w + 1} of {args.windows} windows)"]
                lines = table(done + runs, batch * block, peaks)
                with open(args.out + ".tmp", "w") as out:
                    out.write("\n".join([*about, *notes, *partial, "", *lines]) + "\n")
                os.replace(args.out + ".tmp", args.out)
        for run in runs:   # the figures stay, the models and their compiled code go
            for key in ("model", "opt", "fn"):
                del run[key]
        done += runs
        del model, opt
        if compiled:
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(about + [""] + table(done, batch * block, peaks)))
    return done


def table(runs, tokens, peaks):
    """The markdown table of the runs so far and, per mode, STEP's last stage against vanilla."""
    lines = ["| model | mode | params trained / frozen | GFLOP/step | compile s | tokens/s | TFLOP/s | MFU "
             "| vs nanoGPT same mode |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    by = {}
    for run in runs:
        run["tokens_s"] = tokens / statistics.median(run["times"])
        run["tflops"] = run["flops"] * run["tokens_s"] / 1e12
        by[run["mode"], run["name"]] = run
    for run in runs:
        nano = by.get((run["mode"], "nanoGPT"))
        vs = "" if not nano or nano is run else f"{run['tokens_s'] / nano['tokens_s']:.2f}x"
        if vs and run["flops"] != nano["flops"]:
            vs += f" (TFLOP/s {run['tflops'] / nano['tflops']:.2f}x)"
        peak = peaks[run["mode"].split("-")[1]]
        compile_s = "-" if run["compile_s"] is None else f"{run['compile_s']:.1f}"
        lines.append(f"| {run['name']} | {run['mode']} | {run['trained'] / 1e6:.2f}M / "
                     f"{run['frozen'] / 1e6:.2f}M | {run['flops'] * tokens / 1e9:.3f} | {compile_s} | "
                     f"{run['tokens_s']:,.0f} | {run['tflops']:.4g} | "
                     f"{100 * run['tflops'] * 1e12 / peak:.1f} % | {vs} |")
    for mode in dict.fromkeys(run["mode"] for run in runs):
        ours = [run for run in runs if run["mode"] == mode and run["name"].startswith("ours STEP")]
        vanilla = by[mode, "ours vanilla"]
        if ours and ours[-1]["frozen"]:
            last = ours[-1]
            lines.append(f"STEP last stage / vanilla ({mode}): {vanilla['tokens_s'] / last['tokens_s']:.3f} "
                         f"measured step time; {last['flops'] / vanilla['flops']:.3f} in "
                         f"training matmul FLOPs")
    return lines


if __name__ == "__main__":
    main()
