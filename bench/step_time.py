"""Training step time of STEP's last stage against vanilla pre-training of the same final model.

    python bench/step_time.py                                          # step_small, on this machine
    python bench/step_time.py config/step_350m.py --layers 8 --batch 1 --block 512 --vocab 8192
    python bench/step_time.py --out step_time.md     # also the table as a file, rewritten after each window

Both models have the same depth, width, batch and sequence length; STEP's has its first layers
frozen (int8 + LoRA), as in its last stage. A step is forward, backward and the optimizer step
(train.configure_optimizer's AdamW). The two are timed in alternating windows, so that a change in
the machine's speed hits both; warm-up steps are left out; the result is the median window.

The expectation is the ratio of training matmul FLOPs (model.estimate_flops: 6 per trainable
weight, 4 per frozen one, which needs no weight gradient, plus the adapters and attention), and the
simpler (4 x frozen + 6 x trainable) / (6 x all) over the layers alone.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
import frozen_linear
import grow
import train
from data.load import planned_vocab
from model import GPT
from stepgpt import kernels, runtime
from stepgpt.config import load_config


def build(tcfg, n_layer, n_frozen, vocab, block, device):
    cfg = grow.model_config(tcfg, n_layer, vocab)
    cfg.block_size, cfg.frozen_layers = block, tuple(range(n_frozen))
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    return model, train.configure_optimizer(model, tcfg, device)


def step(model, opt, x, y, autocast, **kw):
    """One training step; kw goes to the model's forward (ours: loss_chunk, as train.py passes it)."""
    with autocast:
        loss = model(x, y, **kw)[1]   # not a name for the logits: they would live through the step
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="config/step_small.py")
    p.add_argument("--layers", type=int, default=0,
                   help="depth of both models (default: the config's final depth)")
    p.add_argument("--frozen", type=int, default=0,
                   help="STEP's frozen layers (default: all but the last stage's)")
    p.add_argument("--batch", type=int, default=0,
                   help="sequences per step (default: the config's batch_size)")
    p.add_argument("--block", type=int, default=0,
                   help="tokens per sequence (default: the config's block_size)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (default: the config's data)")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per window")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override, e.g. --set device=cpu or --set compile=False (repeatable)")
    p.add_argument("--out", help="also write the table to this file, after each window (a run stopped at a "
                                 "time limit leaves the windows it finished)")
    args = p.parse_args(argv)

    tcfg = load_config([args.config] + [f"--{s}" for s in args.set])
    n_layer = args.layers or grow.final_depth(tcfg)
    if args.frozen:
        n_frozen = args.frozen
    else:   # the last stage of the config's plan, scaled to n_layer
        vocab = args.vocab or planned_vocab(tcfg.data_dir, tcfg.vocab_size)[0]
        plan = grow.plan_stages(grow.model_config(tcfg, n_layer, vocab), n_layer, grow.stage_count(tcfg))
        n_frozen = n_layer - plan[-1]
    if not 0 < n_frozen < n_layer:
        sys.exit(f"bench/step_time.py: --frozen {n_frozen} must be between 1 and {n_layer - 1}")
    vocab = args.vocab or planned_vocab(tcfg.data_dir, tcfg.vocab_size)[0]
    batch, block = args.batch or tcfg.batch_size, args.block or tcfg.block_size
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(tcfg.device if tcfg.device != "auto" else auto)
    # as train.py runs: its precision (bf16 autocast on CUDA), TF32, compile, and kernel paths
    dtype, autocast, compiled = runtime.precision(tcfg, device)

    runs = {}
    for name, frozen in (("vanilla", 0), (f"STEP, {n_frozen} of {n_layer} frozen", n_frozen)):
        model, opt = build(tcfg, n_layer, frozen, vocab, block, device)
        kernels.measure_layers(model, batch * block, getattr(torch, dtype),
                               (frozen_linear.forward, frozen_linear.backward))
        fn = torch.compile(model) if compiled else model
        runs[name] = dict(model=model, fn=fn, opt=opt, times=[], flops=model.estimate_flops())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, block), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, block), generator=g).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    for run in runs.values():
        for _ in range(args.warmup):
            step(run["fn"], run["opt"], x, y, autocast, loss_chunk=tcfg.loss_chunk)
    c, f, r = tcfg.n_embd, tcfg.ffn_hidden, tcfg.lora_rank
    about = (f"{args.config}: {n_layer} layers, n_embd {c}, ffn {f}, lora rank {r}, vocab {vocab}; "
             f"batch {batch} x {block} tokens; {device.type}, {dtype}{', compiled' if compiled else ''}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.windows} windows of "
             f"{args.steps} steps after {args.warmup} warm-up")
    for w in range(args.windows):
        for name in (list(runs) if w % 2 == 0 else list(runs)[::-1]):   # alternate who goes first
            run = runs[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(run["fn"], run["opt"], x, y, autocast, loss_chunk=tcfg.loss_chunk)
            sync()
            run["times"].append((time.perf_counter() - t0) / args.steps)
        if args.out:
            partial = [f"(partial: {w + 1} of {args.windows} windows)"] if w + 1 < args.windows else []
            lines = table(runs, n_layer, n_frozen, batch, block)[0]
            with open(args.out + ".tmp", "w") as out:
                out.write("\n".join([about, *partial, "", *lines]) + "\n")
            os.replace(args.out + ".tmp", args.out)
    lines, ratio = table(runs, n_layer, n_frozen, batch, block)
    print("\n".join([about] + lines))
    return ratio


def table(runs, n_layer, n_frozen, batch, block):
    """-> (the table and the ratio line as text lines, STEP's median step time over vanilla's)."""
    lines = [f"| {'model':<24} | {'trainable':>10} | {'frozen':>10} | {'GFLOP/step':>10} | "
             f"{'median s/step':>13} | {'min':>7} | {'max':>7} |",
             f"|{'-' * 26}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 15}|{'-' * 9}|{'-' * 9}|"]
    medians = {}
    for name, run in runs.items():
        trainable, frozen = run["model"].num_params()
        medians[name] = statistics.median(run["times"])
        lines.append(f"| {name:<24} | {trainable / 1e6:9.2f}M | {frozen / 1e6:9.2f}M | "
                     f"{run['flops'] * batch * block / 1e9:10.2f} | {medians[name]:13.4f} | "
                     f"{min(run['times']):7.4f} | {max(run['times']):7.4f} |")
    (vanilla, t_vanilla), (stepped, t_step) = zip(runs.values(), medians.values())
    ratio = t_step / t_vanilla
    simple = (4 * n_frozen + 6 * (n_layer - n_frozen)) / (6 * n_layer)
    lines.append(f"STEP / vanilla step time: {ratio:.3f} measured; {stepped['flops'] / vanilla['flops']:.3f} "
                 f"in training matmul FLOPs (estimate_flops); {simple:.3f} by (4 x frozen + 6 x trainable) / "
                 f"(6 x all) over the layers")
    return lines, ratio


if __name__ == "__main__":
    main()
