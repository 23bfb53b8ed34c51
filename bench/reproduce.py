"""The paper's claims side by side with its baselines and ablations: one command runs the grid,
resumes it when interrupted, and writes one table and two plots.

    python bench/reproduce.py                        # the grid below, small model, CPU: about 1 h on 2 cores
    python bench/reproduce.py --only vanilla-s1,step2-s1 --tokens 200000     # a part, fewer tokens
    python bench/reproduce.py --scale 350m --launcher "torchrun --standalone --nproc_per_node=8"

Every run is train.py on one base config (config/step_small.py; config/step_350m.py with --scale
350m) with a few keys changed: the same data, the same final model (the base's final depth) and the
same total tokens (--tokens, default the base's). Each run has its own out_dir under --out. A
finished run leaves result.json and is skipped the next time; an unfinished one resumes from its
newest checkpoint, so an interrupted grid continues where it stopped (delete a run's folder to
redo it).

Peak memory: on CUDA the run's own torch.cuda.max_memory_allocated (rank 0); on CPU the true peak of
the allocator, measured by bench/peak_memory.py's replay of the run (two steps per stage, stage changes
included) at the run's batch size, so activations and logits are in it. Beside it, the
planner's model-state bytes of the run's peak stage (weights, gradients, AdamW moments, frozen
store; not GaLore's projected state, which the planner does not model).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
import grow
from bench.peak_memory import measure
from data.load import padded_vocab
from stepgpt import memory
from stepgpt.checkpoint import checkpoint_files
from stepgpt.config import load_config
from stepgpt.errors import UserError, run_cli

BASES = {"small": "config/step_small.py", "350m": "config/step_350m.py"}


def split(tokens, k):
    return [tokens // k] * (k - 1) + [tokens - (k - 1) * (tokens // k)]


def grid(base, tokens):
    """[(name, what it is, overrides of the base config)]. Hyper-parameters not named stay the base's."""
    L, d = grow.final_depth(base), base.n_embd
    iters = tokens // (base.batch_size * base.block_size * base.gradient_accumulation_steps)
    k = grow.stage_count(base)
    step2 = (dict(stage_tokens=split(tokens, k)) if k == 2
             else dict(stage_layers=[], target_layers=L, n_stages=2, stage_tokens=split(tokens, 2)))
    vanilla = dict(stage_layers=[L], target_layers=0, n_stages=1, stage_tokens=[tokens])
    warm = tokens // 4   # ReLoRA's full-rank warm start: 5k of its 20k steps
    runs = [("vanilla-s1", "vanilla: every parameter trained from the start", vanilla),
            ("vanilla-s2", "vanilla, second seed", {**vanilla, "seed": base.seed + 1}),
            ("step2-s1", "STEP, 2 stages (the base config)", step2),
            ("step2-s2", "STEP, 2 stages, second seed", {**step2, "seed": base.seed + 1}),
            ("step3", "STEP, 3 stages (planned split)",
             dict(stage_layers=[], target_layers=L, n_stages=3, stage_tokens=split(tokens, 3))),
            # ReLoRA's paper: warm start, then every layer behind rank-128 adapters at width 1024
            # (d/8), merged and restarted every cycle with 99 % of the moments pruned, jagged lr
            ("relora", "ReLoRA: 25 % full-rank warm start, then all layers frozen + LoRA, merge-and-restart",
             dict(stage_layers=[L, 0], target_layers=0, stage_tokens=[warm, tokens - warm], lora_rank=d // 8,
                  lora_alpha=2.0 * (d // 8), relora_every=max(1, (iters - iters // 4) // 4),
                  relora_prune=0.99)),
            # GaLore's paper: rank 256 at width 1024 (d/4), scale 0.25; projection refreshed ~10x a run
            ("galore", "GaLore: full-rank, gradients of the layers' matrices projected",
             {**vanilla, "optimizer": "galore", "galore_rank": d // 4, "galore_scale": 0.25,
              "galore_update_proj_gap": max(1, iters // 10)}),
            ("step2-no-adapters", "STEP-2 without adapters (old layers frozen as they are)",
             {**step2, "lora_rank": 0}),
            ("step2-intermediate", "STEP-2, new layers in the middle third",
             {**step2, "grow_where": "intermediate"}),
            ("step2-lower", "STEP-2, new layers in the lower third", {**step2, "grow_where": "lower"}),
            ("step2-random", "STEP-2, new layers in random gaps", {**step2, "grow_where": "random"}),
            ("step2-bf16", "STEP-2, frozen layers in bf16 (the paper's store)",
             {**step2, "frozen_dtype": "bf16"}),
            ("step2-lora-wd", "STEP-2, weight decay on the adapters too",
             {**step2, "lora_weight_decay": base.weight_decay}),
            ("step2-grow75", "STEP-2, growth at 75 % of each stage's budget (the paper's timing)",
             {**step2, "grow_at": 0.75})]
    # Muon (torch.optim.Muon) on the trained layers' matrices, AdamW as above on the rest; its lr
    # swept around Keller Jordan's 0.02 on seed 1, then a second seed at the base's muon_lr
    for name, what, o in (("vanilla", "vanilla", vanilla), ("step2", "STEP-2", step2)):
        muon = {**o, "optimizer": "muon"}
        runs += [(f"{name}-muon-s1", f"{what}, Muon (muon_lr {base.muon_lr:g})", muon),
                 (f"{name}-muon-s2", f"{what}, Muon, second seed", {**muon, "seed": base.seed + 1})]
        runs += [(f"{name}-muon-lr{lr:g}", f"{what}, Muon at muon_lr {lr:g}", {**muon, "muon_lr": lr})
                 for lr in (base.muon_lr / 2, base.muon_lr * 2)]
    runs += [("step2-muon-lora", "STEP-2, Muon on the adapters too", {**step2, "optimizer": "muon",
                                                                      "muon_adapters": True})]
    return [(name, what, {"grow_where": base.grow_where, **o}) for name, what, o in runs]


def argv_of(base_path, overrides, out_dir, evals):
    args = [base_path] + [f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}"
                          for k, v in overrides.items()]
    return args + [f"--out_dir={out_dir}", f"--eval_interval={evals}", "--sample_tokens=0"]


def planned_state(args, data_vocab):
    """The planner's model-state bytes of the run's peak stage (its optimizer's state)."""
    cfg = load_config(args)
    layers, _ = grow.stage_plan(cfg, padded_vocab(data_vocab), 1)
    final = grow.model_config(cfg, sum(layers), padded_vocab(data_vocab))
    return max(grow.stage_memory(final, layers, memory.state_bytes, train_embeddings=cfg.train_embeddings,
                                 optimizer=memory.planned_optimizer(cfg)))


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finished(out_dir, args):
    """The result out_dir/result.json holds, or None where the run has not finished; refused in one
    line where it was made with other arguments (another --tokens or --set: not this run)."""
    done = os.path.join(out_dir, "result.json")
    if not os.path.isfile(done):
        return None
    with open(done) as f:
        result = json.load(f)
    if result["args"] != args:
        raise UserError(f"{done} is from other settings ({shlex.join(result['args'])}); "
                        f"use another --out, or delete {out_dir} to redo it")
    return result


def train(name, args, out_dir, launcher, log, script):
    """Train one run of `script`'s grid, or resume it from its newest checkpoint: train.py's output
    appended to out_dir/train.log. -> the seconds of every attempt (out_dir/wall.json: a resumed
    run has several)."""
    os.makedirs(out_dir, exist_ok=True)
    resume = bool(checkpoint_files(out_dir))
    cmd = launcher + ["train.py"] + args + (["--init_from=resume"] if resume else [])
    log(f"{name}: {'resuming' if resume else 'starting'}: {shlex.join(cmd)}")
    t0 = time.time()
    with open(os.path.join(out_dir, "train.log"), "a") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    wall_path = os.path.join(out_dir, "wall.json")
    walls = []
    if os.path.isfile(wall_path):
        with open(wall_path) as f:
            walls = json.load(f)
    walls.append(time.time() - t0)
    save_json(wall_path, walls)
    if rc != 0:
        raise UserError(f"run {name} failed (exit {rc}); see {os.path.join(out_dir, 'train.log')}; "
                        f"run {script} again to resume it")
    return walls


def save_json(path, value):
    """value as JSON at path, written under a temporary name and renamed: never half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)
    return value


def run_one(name, args, out_dir, launcher, log):
    """Train (or resume) one run; -> its result dict (also written to out_dir/result.json)."""
    result = finished(out_dir, args)
    if result is not None:
        return result
    walls = train(name, args, out_dir, launcher, log, "bench/reproduce.py")
    recs = read_metrics(out_dir)
    cfg = load_config(args)
    per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    vals = [r for r in recs if "val_loss" in r]
    stage_starts = [r["step"] for a, r in zip(recs, recs[1:])
                    if r.get("stage", 0) > a.get("stage", r.get("stage", 0))]
    cuda = [r["cuda_max_allocated"] for r in recs if r.get("cuda_max_allocated")]
    with open(os.path.join(cfg.data_dir, "meta.json")) as f:
        data_vocab = json.load(f)["vocab_size"]
    result = {"name": name, "final_val": vals[-1]["val_loss"], "best_val": min(r["val_loss"] for r in vals),
              "tokens": vals[-1]["step"] * per_iter, "wall_s": sum(walls),
              "peak_bytes": max(cuda) if cuda else max(r["peak"] for r in measure(args)),
              "peak_source": "cuda max allocated (rank 0)" if cuda else "cpu profiler",
              "planned_bytes": None if cfg.optimizer == "galore" else planned_state(args, data_vocab),
              "val_curve": [(r["step"] * per_iter, r["val_loss"]) for r in vals],
              "stage_starts": [s * per_iter for s in stage_starts], "args": args}
    return save_json(os.path.join(out_dir, "result.json"), result)


def table(rows, whats):
    vanilla = next((r for r in rows if r["name"].startswith("vanilla")), None)
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"   # noqa: E731
    out = ["| run | what | final val | best val | peak MiB (measured) | vs vanilla "
           "| model state MiB (planned) | tokens | wall min |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['peak_bytes'] / vanilla['peak_bytes']:.2f}x" if vanilla else "-"
        out.append(f"| {r['name']} | {whats[r['name']]} | {r['final_val']:.4f} | {r['best_val']:.4f} | "
                   f"{mib(r['peak_bytes'])} | {ratio} | {mib(r['planned_bytes'])} | {r['tokens']:,} | "
                   f"{r['wall_s'] / 60:.1f} |")
    return "\n".join(out)


def plot(rows, path):
    """Val loss against tokens for every run, stage starts marked; peak memory per run as bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib)"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(rows):
        (x, y), c = zip(*r["val_curve"]), f"C{i % 10}"
        muon = "-muon" in r["name"]   # Muon's runs marked x, its lr sweep dash-dotted
        style = ("-." if "-lr" in r["name"] else "--" if muon
                 else "-" if r["name"].startswith(("vanilla", "step2-s"))
                 else "--" if r["name"].startswith("step2-") else "-.")
        ax.plot(x, y, style, color=c, marker="x" if muon else ".",
                label=f"{r['name']} ({r['final_val']:.3f})")
        for s in r["stage_starts"]:
            ax.axvline(s, color=c, alpha=0.35, linestyle=":")
    finals = [r["final_val"] for r in rows]
    ax.set_ylim(min(finals) - 0.15, max(finals) + 0.6)
    ax.set_xlabel("tokens")
    ax.set_ylabel("val loss")
    ax.set_title("val loss (dotted: stage starts)")
    ax.legend(fontsize=7, ncol=2)
    names = [r["name"] for r in rows]
    bx.barh(names, [r["peak_bytes"] / 2**20 for r in rows], color=[f"C{i % 10}" for i in range(len(rows))],
            label="measured peak")
    bx.barh(names, [(r["planned_bytes"] or 0) / 2**20 for r in rows], color="none", edgecolor="black",
            hatch="//", label="planned model state")
    bx.invert_yaxis()
    bx.set_xlabel("MiB")
    bx.set_title(f"peak memory ({rows[0]['peak_source']})")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plots written to {path}"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=sorted(BASES), default="small", help="the base config (default small)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per run (default: the base config's)")
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--out", default="out-reproduce", help="folder of the runs, the table and the plots")
    p.add_argument("--launcher", default="",
                   help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    p.add_argument("--evals", type=int, default=12, help="evaluations per run (the points of the val curve)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override for every run, e.g. --set batch_size=8 (repeatable)")
    a = p.parse_args(argv)
    base_path = BASES[a.scale]
    extra = [f"--{s}" for s in a.set]
    base = load_config([os.path.join(ROOT, base_path)] + extra)
    tokens = a.tokens or sum(base.stage_tokens)
    if not tokens:
        raise UserError(f"{base_path} has no stage_tokens; give --tokens")
    runs = grid(base, tokens)
    if a.only:
        known = {n for n, _, _ in runs}
        wanted = a.only.split(",")
        if set(wanted) - known:
            raise UserError(f"--only: unknown run(s) {sorted(set(wanted) - known)}; "
                            f"the grid has {[n for n, _, _ in runs]}")
        runs = [r for r in runs if r[0] in wanted]
    per_iter = base.batch_size * base.block_size * base.gradient_accumulation_steps
    evals = max(1, tokens // per_iter // a.evals)
    launcher = shlex.split(a.launcher) if a.launcher else [sys.executable]
    os.makedirs(a.out, exist_ok=True)
    log = lambda msg: print(f"[reproduce {time.strftime('%H:%M:%S')}] {msg}", flush=True)   # noqa: E731
    log(f"{len(runs)} runs of {tokens:,} tokens on {base_path}"
        f"{' ' + ' '.join(extra) if extra else ''} into {a.out}")
    rows = []
    for name, _, overrides in runs:
        args = argv_of(base_path, overrides, os.path.abspath(os.path.join(a.out, name)), evals) + extra
        r = run_one(name, args, os.path.join(a.out, name), launcher, log)
        log(f"{name}: final val {r['final_val']:.4f}, peak {r['peak_bytes'] / 2**20:.1f} MiB, "
            f"{r['wall_s'] / 60:.1f} min")
        rows.append(r)
    whats = {n: w for n, w, _ in grid(base, tokens)}
    text = table(rows, whats)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    log(plot(rows, os.path.join(a.out, "reproduce.png")))


if __name__ == "__main__":
    run_cli(main)
