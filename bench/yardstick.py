"""The field's yardstick, LLaMA 60M-1B pre-trained on C4 as GaLore's Table 2 was made, vanilla and
STEP side by side, each also with Muon (config/c4_*.py): each run's plan and the time it needs, the
grid that runs them, and the table of what they reached beside the published numbers
(docs/yardstick.md).

    python bench/yardstick.py --plan                 # stages, memory, FLOPs and hours of the 16 configs
    python bench/yardstick.py                        # the grid, 60M first (vanilla, STEP, their Muon twins)
    python bench/yardstick.py --only c4_60m,c4_step_60m --launcher "torchrun --standalone --nproc_per_node=8"

--plan: each config's stages (Eq. 3), its model state and planned step peak per stage (the numbers
`python plan.py CONFIG` prints, bf16 autocast at the config's micro-batch), the training FLOPs per
token of each stage's model (model.estimate_flops: 6 per trainable weight, 4 per frozen one, plus
attention), and the hours the steps and evaluations take at a stated MFU of a stated GPU's peak
(--mfu, --gpu), with Muon's Newton-Schulz (once a step) for the Muon twins. Evaluations count as
forward passes (a third of a vanilla step's FLOPs) over eval_tokens tokens, padding not counted, and
eval_iters training batches.

The grid: every run is `train.py config/c4_NAME.py` with its own out_dir under --out (and the
--set overrides of every run). A run that reached its last step leaves result.json and is skipped
the next time; one that stopped early (a kill, a preemption, stop_at) resumes from its newest
checkpoint: an interrupted grid continues where it stopped. --out/table.md: final val loss and
perplexity (eval_tokens of the val split), the peak GPU memory (torch.cuda.max_memory_allocated,
rank 0; n/a on a CPU), tokens/s (the median of the log's), beside the published perplexities.
"""
import argparse
import os
import shlex
import statistics
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
import torch

import grow
from data.load import padded_vocab
from model import GPT, FrozenLoRALinear
from stepgpt import memory
from bench.reproduce import finished, save_json, train
from stepgpt.config import load_config
from stepgpt.errors import UserError, run_cli
from stepgpt.monitor import PEAK_FLOPS, perplexity, read_metrics

SIZES = ("60m", "130m", "350m", "1b")
CONFIGS = [f"c4_{kind}{size}" for size in SIZES for kind in ("", "step_", "muon_", "step_muon_")]
# validation perplexity on C4 after the recipe of config/c4_*.py (GaLore, ICML 2024, Table 2; Fira and
# APOLLO-Mini report on the same setting): 60M, 130M, 350M, 1B
PUBLISHED = {"Full-rank Adam (GaLore, Table 2)": (34.06, 25.08, 18.80, 15.56),
             "GaLore": (34.88, 25.36, 18.95, 15.64), "LoRA": (34.99, 33.92, 25.58, 19.21),
             "ReLoRA": (37.04, 29.37, 29.08, 18.33), "Fira": (31.06, 22.73, 17.03, 14.31),
             "APOLLO-Mini (lr 0.02)": (30.95, 22.85, 16.63, 13.95)}
GIB = 2**30


def size_of(name):
    return name.rsplit("_", 1)[1]


def load(name, extra=()):
    return load_config([os.path.join(ROOT, "config", f"{name}.py"), *extra])


def stage_flops(tcfg, vocab, depth, frozen):
    """Training FLOPs per token of a stage's model (depth layers, the first `frozen` of them frozen
    behind adapters), counted by model.estimate_flops on the meta device (no memory, no values)."""
    cfg = grow.model_config(tcfg, depth, vocab)
    cfg.frozen_layers = tuple(range(frozen))
    with torch.device("meta"), mock.patch.object(FrozenLoRALinear, "store", lambda self, w, **kw: None):
        return GPT(cfg).estimate_flops()


def newton_schulz_flops(shapes, steps=5):
    """torch.optim.Muon's orthogonalisation of each (rows, cols) matrix, m x n with m the smaller side:
    per iteration X X^T (2 m^2 n), the Gram matrix squared (2 m^3) and its product with X (2 m^2 n)."""
    return sum(steps * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for a, b in shapes)


def plan_row(name, mfu, peak_flops):
    """-> the --plan table's cells of one config."""
    tcfg = load(name)
    vocab = padded_vocab(tcfg.vocab_size)
    per_iter = tcfg.batch_size * tcfg.block_size * tcfg.gradient_accumulation_steps
    layers, iters = grow.stage_plan(tcfg, vocab, per_iter)
    depth = [sum(layers[:i + 1]) for i in range(len(layers))]
    final = grow.model_config(tcfg, depth[-1], vocab)
    state = grow.stage_memory(final, layers, memory.state_bytes, train_embeddings=tcfg.train_embeddings,
                              optimizer=memory.planned_optimizer(tcfg))
    peaks = memory.configured_peaks(tcfg, final, layers, "bfloat16")
    flops = [stage_flops(tcfg, vocab, d, d - n) for d, n in zip(depth, layers)]
    train = sum(n * per_iter * f for n, f in zip(iters, flops))
    if tcfg.optimizer == "muon":   # Newton-Schulz, once a step, on each stage's Muon matrices
        opt = memory.planned_optimizer(tcfg)
        train += sum(n * newton_schulz_flops(memory.muon_shapes(final, k, d - k, opt == "muon+lora"))
                     for n, k, d in zip(iters, layers, depth))
    evals = sum(iters) // tcfg.eval_interval + 1
    eval_tokens = tcfg.eval_tokens + tcfg.eval_iters * tcfg.batch_size * tcfg.block_size
    forward = stage_flops(tcfg, vocab, depth[-1], 0) / 3   # a forward pass: a third of a vanilla step
    hours = (train + evals * eval_tokens * forward) / (mfu * peak_flops) / 3600
    cells = [f"`{name}`", f"{grow.param_count(final) / 1e6:.1f}M", " + ".join(map(str, layers)),
             " / ".join(f"{n:,}" for n in iters), " / ".join(f"{b / GIB:.2f}" for b in state),
             " / ".join(f"{p / GIB:.1f}" for p in peaks), " / ".join(f"{f / 1e6:.0f}" for f in flops),
             f"{sum(iters) * per_iter / 1e9:.2f}B", f"{hours:.2f}", f"{hours / 8:.2f}"]
    return cells, max(peaks)


def plan_table(names, mfu, gpu):
    peak_flops = PEAK_FLOPS[gpu]
    lines = [f"At {100 * mfu:.0f} % MFU of one {gpu} ({peak_flops / 1e12:.0f} TFLOP/s dense bf16); "
             f"8 GPUs at the same MFU take an eighth. Per stage: model state (int8 accounting, fp32 AdamW, "
             f"or Muon's one fp32 buffer on the layers' matrices), planned bf16 step peak at the config's "
             f"micro-batch (vs vanilla: the peak against the AdamW vanilla run's), training FLOPs per token.",
             "",
             "| config | parameters | layers per stage | steps per stage | model state GiB | step peak GiB "
             "| vs vanilla | MFLOPs/token | tokens | hours, 1 GPU | hours, 8 GPUs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    vanilla = {}
    for name in names:
        cells, peak = plan_row(name, mfu, peak_flops)
        if name == f"c4_{size_of(name)}":   # the published recipe, AdamW
            vanilla[size_of(name)] = peak
        base = vanilla.get(size_of(name))
        cells.insert(6, f"{peak / base:.2f}x" if base else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the grid

def total_iters(cfg):
    per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    return sum(grow.stage_plan(cfg, padded_vocab(cfg.vocab_size or 64), per_iter)[1])


def run_one(name, args, out_dir, launcher, log):
    """Train, resume or skip one run. -> its result (also out_dir/result.json), or None where it
    stopped before its last step without an error (stop_at)."""
    result = finished(out_dir, args)
    if result is not None:
        return result
    walls = train(name, args, out_dir, launcher, log, "bench/yardstick.py")
    cfg = load_config(args)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))[0]
    evals = [r for r in records if "val_loss" in r]
    last = total_iters(cfg)
    if not evals or evals[-1]["step"] != last:
        log(f"{name}: stopped at step {evals[-1]['step'] if evals else 0} of {last}; run again to continue")
        return None
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    cuda = [r["cuda_max_allocated"] for r in records if r.get("cuda_max_allocated")]
    result = {"name": name, "final_val": evals[-1]["val_loss"], "ppl": perplexity(evals[-1]["val_loss"]),
              "steps": last, "tokens_per_s": statistics.median(speeds[1:] or speeds) if speeds else None,
              "peak_bytes": max(cuda) if cuda else None, "wall_s": sum(walls), "args": args}
    return save_json(os.path.join(out_dir, "result.json"), result)


def results_table(rows):
    """Our runs beside the published full-rank Adam perplexity at the same size, then the published rows."""
    adam = dict(zip(SIZES, PUBLISHED["Full-rank Adam (GaLore, Table 2)"]))
    out = ["| run | steps | final val loss | val perplexity | full-rank Adam, published | peak GiB (GPU) "
           "| tokens/s | wall h |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "n/a (no GPU)" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GIB:.2f}"
        speed = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        out.append(f"| {r['name']} | {r['steps']:,} | {r['final_val']:.4f} | {r['ppl']:.2f} | "
                   f"{adam[size_of(r['name'])]:.2f} | {peak} | {speed} | {r['wall_s'] / 3600:.2f} |")
    out += ["", "| published (validation perplexity) | " + " | ".join(s.upper() for s in SIZES) + " |",
            "|---|" + "---|" * len(SIZES)]
    out += [f"| {method} | " + " | ".join(f"{p:.2f}" for p in ppl) + " |"
            for method, ppl in PUBLISHED.items()]
    return "\n".join(out)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="print the plan and time table, run nothing")
    p.add_argument("--mfu", type=float, default=0.4, help="--plan: the model FLOPs utilisation assumed")
    p.add_argument("--gpu", default="H100", choices=sorted(PEAK_FLOPS), help="--plan: whose peak FLOP/s")
    p.add_argument("--only", default="", help=f"comma-separated configs (default: all, in order: {CONFIGS})")
    p.add_argument("--out", default="out-yardstick", help="folder of the runs and table.md")
    p.add_argument("--launcher", default="",
                   help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override for every run, e.g. --set data_dir=data/c4 (repeatable)")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else CONFIGS
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise UserError(f"--only: unknown config(s) {unknown}; the grid has {CONFIGS}")
    if a.plan:
        if not 0 < a.mfu <= 1:
            raise UserError(f"--mfu {a.mfu}: give a share of the peak, in (0, 1]")
        print(plan_table(names, a.mfu, a.gpu))
        return
    extra = [f"--{s}" for s in a.set]
    launcher = shlex.split(a.launcher) if a.launcher else [sys.executable]
    log = lambda msg: print(f"[yardstick {time.strftime('%H:%M:%S')}] {msg}", flush=True)   # noqa: E731
    rows = []
    for name in names:
        out_dir = os.path.abspath(os.path.join(a.out, name))
        args = [f"config/{name}.py", f"--out_dir={out_dir}"] + extra
        r = run_one(name, args, out_dir, launcher, log)
        if r:
            log(f"{name}: val loss {r['final_val']:.4f}, perplexity {r['ppl']:.2f}")
            rows.append(r)
    text = results_table(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    run_cli(main)
