r"""The true peak memory of training steps, measured from the allocator, beside the planner's
prediction: vanilla against STEP with 2 and 3 stages, with and without activation checkpointing
and the chunked loss, with 8-bit AdamW or Muon.

    python bench/peak_memory.py                              # config/step_small.py's model on CPU, ~3 min
    python bench/peak_memory.py --set batch_size=4 --only vanilla,step2
    python bench/peak_memory.py --modes plain,muon           # AdamW against Muon (optimizer=muon), ~2 min
    python bench/peak_memory.py --meta config/step_350m.py,config/step_1b.py   # paper scale, seconds
    python bench/peak_memory.py --device cuda --config config/step_1b.py --modes plain,ckpt+chunk \
        --set batch_size=1
    python bench/peak_memory.py --ranks 2 --only step2          # FSDP against DDP, per rank, ~2 min

Each run replays two training steps per stage (AdamW creates its moments in the first step's
update, after that step's backward has peaked; from the second step on they are live through the
backward) and stage changes in between, under the profiler, which records every CPU allocation
and free; the peak of each window is read from that timeline. With --device cuda the peak of each
window is torch.cuda.max_memory_allocated (bench/gpu_check.sh runs it; train.py's log line shows the
same counter for a whole run). The prediction is the planner's memory.step_peak_bytes: model state
without gradients + the activations autograd saves (fp32), or the full state at the optimizer step
with its temporaries, whichever is larger (on CUDA bf16 autocast saves other tensors, so there the
prediction is an fp32 reference, not a model of what autocast keeps).

--ranks 2 replays the run on 2 gloo ranks (CPU), once under DDP and once under FSDP (fsdp=True), and
gives each rank's peak per window beside the planner's per-rank prediction (memory.step_peak_bytes,
with fsdp_world for FSDP; DDP's gradient buckets, a second copy of the gradients, are not planned).
The allocation timeline there comes from the profiler's events (cpu_allocation_timeline).

--meta builds each stage's model of a big config on the meta device (shapes and dtypes, no memory):
its parameters and buffers as the module holds them, a gradient per trainable parameter and the
optimizer state that the optimizer's own initialisation creates, beside memory.state_bytes.
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import time
from unittest import mock
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
import grow
import train
from data.load import planned_vocab
from model import GPT, FrozenLoRALinear
from stepgpt import kernels, memory
from stepgpt.config import load_config
from stepgpt.errors import UserError, run_cli

RUNS = ("vanilla", "step2", "step3")   # the config's final depth trained in 1, 2 or 3 planned stages
MODES = {"plain": [], "ckpt": ["--activation_checkpointing=True"], "chunk": ["--loss_chunk=256"],
         "ckpt+chunk": ["--activation_checkpointing=True", "--loss_chunk=256"],
         "adamw8bit": ["--optimizer=adamw8bit"],   # needs bitsandbytes
         "muon": ["--optimizer=muon"]}


def cpu_memory_timeline(fn):
    """Run fn() and record the CPU tensor memory it allocates, from the profiler's record of every
    allocation and free (not from a list of tensors we think exist). -> [(time.time_ns(), bytes
    live)], one entry per event. The timeline is a private torch API (torch 2.13); CUDA has
    torch.cuda.max_memory_allocated instead."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    live, out = 0, [(0, 0)]
    for t, action, _, size in prof._memory_profile().timeline:
        if action in (Action.CREATE, Action.PREEXISTING):
            live += size
        elif action == Action.DESTROY:
            live -= size
        out.append((t, live))
    return out


def cpu_allocation_timeline(fn):
    """cpu_memory_timeline without record_shapes, whose weak references stop FSDP2's to_empty from
    swapping a module's tensors: the profiler's raw record of every CPU allocation and free.
    -> [(time.time_ns(), bytes live)]."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    moves = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                   if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live, out = 0, [(0, 0)]
    for t, size in moves:
        live += size
        out.append((t, live))
    return out


def measure_cpu_memory(fn):
    """-> (peak bytes, bytes still allocated when fn returns) of fn()'s CPU tensor allocations."""
    timeline = cpu_memory_timeline(fn)
    return max(b for _, b in timeline), timeline[-1][1]


def run_args(config, name, extra=()):
    """train.py overrides that make `config` (with the overrides `extra`) the run `name` of RUNS."""
    depth = grow.final_depth(load_config([config, *extra]))
    if name == "vanilla":   # measure() sets each stage's tokens
        return [f"--stage_layers=[{depth}]", "--stage_tokens=[]"]
    return ["--stage_layers=[]", f"--target_layers={depth}", f"--n_stages={name.removeprefix('step')}",
            "--stage_tokens=[]"]


def measure(args, device="cpu", timeline=cpu_memory_timeline):
    """Replay the run `args` (train.py argv): two steps per stage, stage changes between (under
    torchrun's variables, on its ranks: DDP, or FSDP with fsdp=True).
    -> [dict(phase, stage, n_trainable, n_frozen, tokens, peak)] with phase 'step' (the second
    step of a stage) or 'stage change' (the growth and the new optimizer, first step included).
    device "cuda": the peaks are torch.cuda.max_memory_allocated per window (eager, bf16 autocast)."""
    cfg = load_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
        cfg = replace(cfg, out_dir=tmp, stage_tokens=[2 * per_iter] * grow.stage_count(cfg), grow_at=1.0,
                      relora_every=0, device=device, init_from="scratch", log_interval=10**9, compile=False,
                      sample_tokens=0)   # steps only: no final sample, so no tokenizer needed
        marks, shapes, cuda_peaks = [], [], []

        def mark(*m):
            if device == "cuda":   # the peak of the window that ends here (the kernels' measurement
                torch.cuda.synchronize()   # at a stage change left out), then a new window
                cuda_peaks.append(kernels.training_peak("cuda"))
                kernels.reset_peak("cuda")
            marks.append(m)

        def replay():
            run = train.setup(cfg)
            model, opt, it, _ = train.build(run)
            stepped, _ = train.wrap(run, model)   # the DDP wrapper on 2 ranks (compile is off)
            for stage in range(len(run.depth)):
                mark("stage change", stage, time.time_ns())
                if stage:
                    model, opt, stepped, _ = train.enter_stage(run, model, opt, stage, it)
                train.train_step(run, stepped, model, opt, it)
                mark("step", stage, time.time_ns())
                train.train_step(run, stepped, model, opt, it + 1)
                it += 2
                n_frozen = len(model.config.frozen_layers)
                shapes.append((model.config.n_layer - n_frozen, n_frozen))
            mark("end", len(run.depth), time.time_ns())

        quiet = open(os.devnull, "w")
        stdout, sys.stdout = sys.stdout, quiet
        try:
            timeline = timeline(replay) if device == "cpu" else replay()
        finally:
            sys.stdout = stdout
            quiet.close()
    out = []
    for i, ((phase, stage, t0), (_, _, t1)) in enumerate(zip(marks, marks[1:])):
        peak = (cuda_peaks[i + 1] if device == "cuda"
                else max((b for t, b in timeline if t0 <= t < t1), default=0))
        out.append(dict(phase=phase, stage=stage, n_trainable=shapes[stage][0], n_frozen=shapes[stage][1],
                        tokens=cfg.batch_size * cfg.block_size, peak=peak))
    return out


def meta_state(tcfg, vocab, n_trainable, n_frozen):
    """-> (model-state bytes, of which the RoPE tables) of a model with n_frozen frozen and
    n_trainable trainable layers of the run config tcfg, built on the meta device."""
    cfg = grow.model_config(tcfg, n_trainable + n_frozen, vocab)
    cfg.frozen_layers = tuple(range(n_frozen))
    # on the meta device there are no values to quantise: the frozen layers' int8 buffers keep the
    # shapes and dtypes their constructor gave them
    with torch.device("meta"), mock.patch.object(FrozenLoRALinear, "store", lambda self, w, **kw: None):
        model = GPT(cfg)
    if n_frozen and not tcfg.train_embeddings:
        model.freeze_embeddings()
    opt = train.configure_optimizer(model, tcfg, torch.device("meta"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.empty_like(p)
    if tcfg.optimizer == "adamw8bit":   # its update has no meta kernel: the state its first step would create
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                opt.init_state(group, p, gi, pi)
    else:
        opt.step()
    held = [*model.parameters(), *model.buffers(), *(p.grad for p in trainable),
            *(t for p in trainable for k, t in opt.state[p].items() if torch.is_tensor(t) and k != "step")]
    unique = {id(t): t.numel() * t.element_size() for t in held}   # shared tensors (8-bit code books) once
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.startswith("rope_"))
    return sum(unique.values()), rope


def meta_table(configs):
    gib = lambda b: f"{b / 2**30:.4f}"   # noqa: E731
    print("| config | optimizer | stage | layers (trainable + frozen) | planned state GiB "
          "| meta-device state GiB | meta - planned | RoPE tables |")
    print("|---|---|---|---|---|---|---|---|")
    optimizers = ["adamw", "muon"] + (["adamw8bit"] if importlib.util.find_spec("bitsandbytes") else [])
    for path in configs:
        for optimizer in optimizers:
            tcfg = load_config([path, f"--optimizer={optimizer}"])
            vocab = planned_vocab(tcfg.data_dir, tcfg.vocab_size)[0]
            layers, _ = grow.stage_plan(tcfg, vocab, tcfg.batch_size * tcfg.block_size)
            rows = ([("vanilla", sum(layers), 0)]
                    + [(str(i + 1), n, sum(layers[:i])) for i, n in enumerate(layers)])
            for stage, n, f in rows:
                mc = grow.model_config(tcfg, n + f, vocab)
                planned = memory.state_bytes(mc, n, f, train_embeddings=tcfg.train_embeddings or f == 0,
                                             optimizer=memory.planned_optimizer(tcfg))
                held, rope = meta_state(tcfg, vocab, n, f)
                print(f"| {os.path.basename(path)} | {optimizer} | {stage} | {n} + {f} | {gib(planned)} | "
                      f"{gib(held)} | {held - planned:,} B | {rope:,} B |", flush=True)
    if "adamw8bit" not in optimizers:
        print("(no adamw8bit rows: pip install bitsandbytes==0.50.2)")


def predict(cfg, row, device):
    return memory.step_peak_bytes(
        grow.model_config(cfg, row["n_trainable"] + row["n_frozen"], cfg.vocab_size),
        row["n_trainable"], row["n_frozen"], row["tokens"],
        train_embeddings=cfg.train_embeddings or row["n_frozen"] == 0,
        checkpointing=cfg.activation_checkpointing, loss_chunk=cfg.loss_chunk,
        optimizer=memory.planned_optimizer(cfg), dtype="bfloat16" if device == "cuda" else "float32")


def _rank(rank, world, port, args, out):
    """One rank of ranks_table's replay (torch.multiprocessing.spawn)."""
    import json
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    rows = measure(args, timeline=cpu_allocation_timeline)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)


def ranks_table(config, runs, extra, world):
    """The run `config` (each of `runs`) on `world` gloo ranks, under DDP and under FSDP: each rank's
    measured peak per window beside the planned per-rank step peak."""
    import json
    import socket
    mib = lambda b: f"{b / 2**20:,.1f}"   # noqa: E731
    print("| run | sharding | stage | layers (trainable + frozen) | planned peak per rank | "
          + " | ".join(f"rank {r} measured" for r in range(world)) + " | measured - planned |")
    print("|---" * (6 + world) + "|")
    for name in runs:
        for sharding, keys in (("DDP", []), ("FSDP", ["--fsdp=True"])):
            args = [config, *run_args(config, name, extra), f"--gradient_accumulation_steps={world}", *extra,
                    *keys]
            cfg = load_config(args)
            cfg = replace(cfg, vocab_size=planned_vocab(cfg.data_dir, cfg.vocab_size)[0])
            with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                s.close()
                torch.multiprocessing.spawn(_rank, args=(world, port, args, os.path.join(tmp, "rows")),
                                            nprocs=world)
                ranks = [json.load(open(os.path.join(tmp, f"rows.{r}"))) for r in range(world)]
            for i, row in enumerate(ranks[0]):
                peaks = [rows[i]["peak"] for rows in ranks]
                planned = None
                if row["phase"] == "step":
                    mc = grow.model_config(cfg, row["n_trainable"] + row["n_frozen"], cfg.vocab_size)
                    planned = memory.step_peak_bytes(
                        mc, row["n_trainable"], row["n_frozen"], row["tokens"],
                        cfg.train_embeddings or row["n_frozen"] == 0, cfg.activation_checkpointing,
                        cfg.loss_chunk, fsdp_world=world if cfg.fsdp else 1)
                err = f"{(max(peaks) - planned) / planned:+.1%}" if planned else "-"
                print(f"| {name} | {sharding} | {row['stage'] + 1} {row['phase']} | {row['n_trainable']} + "
                      f"{row['n_frozen']} | {mib(planned) if planned else '-'} | "
                      + " | ".join(mib(p) for p in peaks) + f" | {err} |", flush=True)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join("config", "step_small.py"),
                   help="the model (default: step_small)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: torch.cuda.max_memory_allocated per window, bf16 autocast, eager")
    p.add_argument("--only", default="", help=f"comma-separated runs of {list(RUNS)} (default: all)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {list(MODES)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override for every run, e.g. --set batch_size=4 (repeatable)")
    p.add_argument("--ranks", type=int, default=0,
                   help="N: on N gloo ranks (CPU), DDP against FSDP, each rank's peak (plain mode only)")
    p.add_argument("--meta", default="", metavar="CONFIGS",
                   help="comma-separated config files: their model state per stage on the meta device "
                        "instead")
    a = p.parse_args(argv)
    if a.meta:
        return meta_table(a.meta.split(","))
    runs, modes = (a.only.split(",") if a.only else list(RUNS)), a.modes.split(",")
    for name, known in ((runs, RUNS), (modes, MODES)):
        if set(name) - set(known):
            raise UserError(f"unknown {sorted(set(name) - set(known))}: use some of {list(known)}")
    extra = [f"--{s}" for s in a.set]
    if a.ranks:
        return ranks_table(a.config, runs, extra, a.ranks)
    mib = lambda b: f"{b / 2**20:,.1f}"   # noqa: E731
    print("| run | mode | stage | layers (trainable + frozen) | planned state | planned peak | measured peak "
          "| measured - planned | run peak vs vanilla |")
    print("|---|---|---|---|---|---|---|---|---|")
    vanilla = {}
    for mode in modes:
        if mode == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
            print(f"| {', '.join(runs)} | adamw8bit | skipped: optimizer=adamw8bit needs bitsandbytes "
                  f"(pip install bitsandbytes==0.50.2) |||||||", flush=True)
            continue
        for name in runs:
            args = [a.config, *run_args(a.config, name, extra), *MODES[mode], *extra]
            cfg = load_config(args)
            cfg = replace(cfg, vocab_size=planned_vocab(cfg.data_dir, cfg.vocab_size)[0])
            rows = measure(args, a.device)
            run_peak = max(r["peak"] for r in rows)
            vanilla.setdefault(mode, run_peak if name == "vanilla" else None)
            base = vanilla[mode]
            for r in rows:
                mc = grow.model_config(cfg, r["n_trainable"] + r["n_frozen"], cfg.vocab_size)
                state = memory.state_bytes(mc, r["n_trainable"], r["n_frozen"],
                                           train_embeddings=cfg.train_embeddings or r["n_frozen"] == 0,
                                           optimizer=memory.planned_optimizer(cfg))
                planned = predict(cfg, r, a.device) if r["phase"] == "step" else None
                err = f"{(r['peak'] - planned) / planned:+.1%}" if planned else "-"
                print(f"| {name} | {mode} | {r['stage'] + 1} {r['phase']} | "
                      f"{r['n_trainable']} + {r['n_frozen']} | {mib(state)} | "
                      f"{mib(planned) if planned else '-'} | {mib(r['peak'])} | {err} | "
                      f"{f'{run_peak / base:.2f}x' if base and r is rows[-1] else ''} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
