"""The STEP stage plan and memory table of a config: Eq. 3's stages in the paper's accounting and in
ours (int8 store, 8-bit AdamW, ZeRO-1), each stage's model state and the peak of a training step
(the memory model: grow.py's Eq. 1-3 and stepgpt/memory.py); or, with --plot, a picture of each
config's stages as it is set: which layers train and which sit frozen, and each stage's model state
and step peak beside vanilla's. With --fsdp (or a run that sets fsdp or zero1), also what each of
--world GPUs holds under DDP, ZeRO-1 and FSDP, stage by stage; train.py's --key=value overrides apply.

  python plan.py config/step_1b.py [--stages K] [--rank r] [--budget 6e9] [--world 8] [--layers_only]
  python plan.py config/step_small.py config/step_350m.py --plot docs/stages.png
  python plan.py config/step_7b.py --world 2 --fsdp --gpu_gb 24 [--batch_size=1 ...: train.py's keys]
"""
import argparse
import os

import grow
from data.load import padded_vocab, planned_vocab
from stepgpt.config import load_config
from stepgpt.errors import UserError, run_cli
from stepgpt.memory import (GPU_BYTES, configured_peaks, planned_optimizer, settings, sharded_state,
                            smallest_plan, state_bytes, step_peak_bytes)


def final_model(args, config):
    """-> (the run config, the final model's GPTConfig, its depth, where its vocabulary comes from)."""
    tcfg = load_config([config] + ([f"--lora_rank={args.rank}"] if args.rank else []) + args.keys)
    target = grow.final_depth(tcfg)
    vocab, source = ((padded_vocab(args.vocab), f"--vocab {args.vocab}") if args.vocab
                     else planned_vocab(tcfg.data_dir, tcfg.vocab_size))
    return tcfg, grow.model_config(tcfg, target, vocab), target, source


def plan_table(args, config):
    tcfg, cfg, target, source = final_model(args, config)
    vocab = cfg.vocab_size
    emb, only = tcfg.train_embeddings, args.layers_only
    act = dict(checkpointing=tcfg.activation_checkpointing, loss_chunk=tcfg.loss_chunk)
    lean = dict(checkpointing=True, loss_chunk=tcfg.block_size)
    tokens = tcfg.batch_size * tcfg.block_size
    scope = "the layers only, as the paper's Eq. 2-3" if only else "every tensor"
    vanilla = state_bytes(cfg, target, 0, layers_only=only)   # 16 B per parameter
    gib = 2**30
    print(f"{config}: {target} layers, n_embd {cfg.n_embd}, ffn {cfg.ffn_hidden}, vocab "
          f"{cfg.vocab_size} ({source}), {grow.param_count(cfg) / 1e6:.1f}M parameters, lora rank "
          f"{cfg.lora_rank}, embeddings {'trainable' if emb else 'frozen'} in later stages")
    full_vanilla = [step_peak_bytes(cfg, target, 0, tokens, **a) / gib for a in (act, lean)]
    print(f"vanilla (every parameter trained, fp32 AdamW state: 16 B each): {vanilla / gib:.3f} GiB of "
          f"model state, counting {scope}; full peak {full_vanilla[0]:.2f} GiB, ckpt+chunk "
          f"{full_vanilla[1]:.2f} GiB")
    layers, _ = grow.stage_plan(tcfg, vocab, tokens)
    peaks = configured_peaks(tcfg, cfg, layers, "bfloat16")
    vanilla_peak = configured_peaks(tcfg, cfg, [target], "bfloat16")[0]
    stage_peaks = " ".join(f"{p / gib:.1f}" for p in peaks)
    print(f"as configured, on CUDA (bf16 autocast, micro-batch {tcfg.batch_size} x {tcfg.block_size}, "
          f"activation_checkpointing={tcfg.activation_checkpointing}, loss_chunk={tcfg.loss_chunk}, "
          f"optimizer {tcfg.optimizer}): stages {layers}, step peak {stage_peaks} GiB, at most "
          f"{max(peaks) / 1e9:.1f} GB; vanilla {vanilla_peak / gib:.1f} GiB ({vanilla_peak / 1e9:.1f} GB); "
          f"an {GPU_BYTES / 1e9:.0f} GB GPU keeps 10 % free below {0.9 * GPU_BYTES / 1e9:.0f} GB")
    print(f"full peak: the peak stage's training step with activations in fp32 at micro-batch "
          f"{tcfg.batch_size} x {tcfg.block_size} (activation_checkpointing={tcfg.activation_checkpointing}, "
          f"loss_chunk={tcfg.loss_chunk}; every tensor); 'ckpt+chunk': the same with "
          f"activation_checkpointing=True and loss_chunk={tcfg.block_size}; 'bf16': the config's own "
          f"activation keys, bf16 autocast\n")
    stages = [args.stages] if args.stages else sorted({k for k in (2, 3, 4, grow.stage_count(tcfg))
                                                       if 1 < k <= target})
    print(f"{'setting':<22} {'K':>2}  {'layers':<18} {'stage state (GiB)':<30} {'peak GiB':>8}  "
          f"{'vs vanilla':>10}  {'vs vanilla, same setting':>24}  {'full peak GiB':>13} {'ckpt+chunk':>10} "
          f"{'bf16':>6}")
    for name, skw in settings(args.world):
        same = state_bytes(cfg, target, 0, layers_only=only, **skw)
        for k in stages:
            kw = dict(train_embeddings=emb, layers_only=only, **skw)
            layers = grow.plan_stages(cfg, target, k, state_bytes, **kw)
            mem = grow.stage_memory(cfg, layers, state_bytes, **kw)
            full = f"{'-':>13} {'-':>10} {'-':>6}"   # the paper's own activations: not modelled
            if skw["accounting"] == "int8":
                frozen = [sum(layers[:i]) for i in range(k)]
                opt = {key: v for key, v in skw.items() if key != "accounting"}
                peaks = [max(step_peak_bytes(cfg, n, f, tokens, emb or f == 0, **a, **opt)
                             for n, f in zip(layers, frozen)) for a in (act, lean)]
                bf16 = max(step_peak_bytes(cfg, n, f, tokens, emb or f == 0, **act, **opt, dtype="bfloat16")
                           for n, f in zip(layers, frozen))
                full = f"{peaks[0] / gib:13.2f} {peaks[1] / gib:10.2f} {bf16 / gib:6.2f}"
            peak = max(mem)
            print(f"{name:<22} {k:>2}  {str(layers):<18} {' '.join(f'{m / gib:.2f}' for m in mem):<30} "
                  f"{peak / gib:8.2f}  {-100 * (1 - peak / vanilla):9.1f}%  {-100 * (1 - peak / same):23.1f}%"
                  f"  {full}")
    if args.budget:   # Muon is not picked: 8-bit AdamW holds less at the same K and changes training less
        choices = [c for c in settings(args.world) if c[0] not in ("paper bf16", "int8 + Muon")]
        k, name, layers, peak = smallest_plan(cfg, target, args.budget, choices, train_embeddings=emb,
                                              layers_only=only)
        keys = {"int8": "", "int8 + 8-bit AdamW": " --optimizer=adamw8bit"}.get(
            name, f" --zero1=True on {args.world} ranks")
        print(f"\nbudget {args.budget / gib:.2f} GiB of model state: the cheapest plan that fits is K = {k} "
              f"with {name}, layers {layers}, {peak / gib:.2f} GiB (train with "
              f"--stage_layers={layers}{keys})")
    if tcfg.fsdp or tcfg.zero1:
        sharded_table(tcfg, cfg, grow.stage_plan(tcfg, vocab, tokens)[0], args.world, args.gpu_gb)


def sharded_table(tcfg, cfg, layers, world, gpu_gb):
    """What each of `world` GPUs holds in each stage of the run as configured (its stages, micro-batch
    and activation keys; bf16 autocast) under DDP, ZeRO-1 and FSDP, all three with fp32 AdamW state
    (the one optimizer ZeRO-1 and FSDP shard here), or with optimizer=muon under DDP and ZeRO-1 (FSDP
    refuses Muon)."""
    gib, budget = 2**30, 0.9 * gpu_gb * 1e9
    act = dict(checkpointing=tcfg.activation_checkpointing, loss_chunk=tcfg.loss_chunk, dtype="bfloat16")
    opt = planned_optimizer(tcfg) if tcfg.optimizer == "muon" else "adamw"
    label = "AdamW" if opt == "adamw" else "Muon+AdamW"
    print(f"\nper GPU on {world} ranks, GiB ({label} fp32 state, bf16 autocast, micro-batch "
          f"{tcfg.batch_size} x {tcfg.block_size}, activation_checkpointing={tcfg.activation_checkpointing}, "
          f"loss_chunk={tcfg.loss_chunk}); a {gpu_gb:g} GB GPU keeps 10 % free below {budget / gib:.1f} GiB")
    print(f"{'stage':<6} {'layers':<10} {'setting':<10} {'weights':>8} {'grads':>8} {label:>8} "
          f"{'state':>8} {'step peak':>10}  fits")
    frozen = 0
    for i, n in enumerate(layers):
        emb = tcfg.train_embeddings or frozen == 0
        for mode in ("ddp", "zero1") + ("fsdp",) * (opt == "adamw"):
            parts = sharded_state(cfg, n, frozen, world, mode, emb, optimizer=opt)
            shard = {"zero1": dict(zero_world=world), "fsdp": dict(fsdp_world=world)}.get(mode, {})
            peak = step_peak_bytes(cfg, n, frozen, tcfg.batch_size * tcfg.block_size, emb, **act, **shard,
                                   optimizer=opt)
            name = {"ddp": "DDP", "zero1": f"ZeRO-1/{world}", "fsdp": f"FSDP/{world}"}[mode]
            print(f"{i + 1:<6} {f'{n} + {frozen}':<10} {name:<10} "
                  + " ".join(f"{b / gib:8.2f}" for b in (*parts, sum(parts)))
                  + f" {peak / gib:10.2f}  {'yes' if peak <= budget else 'no'}")
        frozen += n


def stage_picture(tcfg, cfg, target):
    """Each stage of the run config as it is set, then vanilla (the same final model, one stage):
    [(name, the layers bottom to top, "T" trains at full rank and "F" sits frozen in int8 + LoRA, model
    state, step peak)]. The numbers are train.py's "planned" line: the model state in our int8
    accounting with the config's optimizer, and the step peak a CUDA run takes (bf16 autocast, the
    config's micro-batch and activation keys)."""
    layers, _ = grow.stage_plan(tcfg, cfg.vocab_size, tcfg.batch_size * tcfg.block_size)
    opt = planned_optimizer(tcfg)
    states = grow.stage_memory(cfg, layers, state_bytes, train_embeddings=tcfg.train_embeddings,
                               optimizer=opt)
    peaks = configured_peaks(tcfg, cfg, layers, "bfloat16")
    out, stack = [], ""
    for i, n in enumerate(layers):
        stack = "F" * len(stack)   # every layer of the earlier stages is frozen; n new ones go in
        if i == 0 or tcfg.grow_init == "stack":
            stack += "T" * n
        else:   # where grow.grow puts them (train.py's seed for stage i)
            gaps = grow.insertion_gaps(len(stack), n, tcfg.grow_where, seed=tcfg.seed + i)
            stack = "".join(old + "T" * gaps.count(j) for j, old in enumerate(stack))
        out.append((f"stage {i + 1}", stack, states[i], peaks[i]))
    return out + [("vanilla", "T" * target, state_bytes(cfg, target, 0, optimizer=opt),
                   configured_peaks(tcfg, cfg, [target], "bfloat16")[0])]


def plot(args):
    """Draw each config's stage_picture into args.plot (one row per config) and print what it drew."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise UserError("plan.py --plot needs matplotlib: pip install matplotlib") from None
    if args.stages or args.budget or args.layers_only:
        raise UserError("--plot draws each config as it is set: leave out --stages, --budget and "
                        "--layers_only")
    folder, fmt = os.path.dirname(args.plot) or ".", os.path.splitext(args.plot)[1][1:].lower()
    if not os.path.isdir(folder):
        raise UserError(f"--plot {args.plot}: there is no folder {folder}")
    fig, axes = plt.subplots(len(args.config), 2, figsize=(11, 3.6 * len(args.config)), squeeze=False,
                             gridspec_kw=dict(width_ratios=[1, 1.15]))
    if fmt not in fig.canvas.get_supported_filetypes():
        raise UserError(f"--plot {args.plot}: name a .png, .svg or .pdf file")
    color = {"T": "#e8833a", "F": "#4c78a8"}
    print(f"{args.plot}: the layers bottom to top (T trains at full rank, F frozen int8 + LoRA), the model "
          f"state (int8 accounting, the config's optimizer) and the step peak (bf16 autocast on CUDA, the "
          f"config's micro-batch), bytes")
    for config, (left, right) in zip(args.config, axes):
        tcfg, cfg, target, _ = final_model(args, config)
        rows = stage_picture(tcfg, cfg, target)
        for name, stack, state, peak in rows:
            print(f"{config}  {name:<8}  {stack:<{target}}  model state {state:>15,}  step peak {peak:>15,}")
        for x, (_, stack, _, _) in enumerate(rows):
            for j, role in enumerate(stack):
                left.add_patch(Rectangle((x - 0.3, j + 0.08), 0.6, 0.84, color=color[role]))
        left.set(xlim=(-0.6, len(rows) - 0.4), ylim=(0, target), ylabel="layer (bottom to top)",
                 title=f"{config}: {grow.param_count(cfg) / 1e6:.1f}M parameters, {target} layers")
        left.yaxis.get_major_locator().set_params(integer=True)
        left.set_xticks(range(len(rows)), [f"{name}\n{s.count('T')} train, {s.count('F')} frozen"
                                           for name, s, _, _ in rows])
        unit, scale = ("GiB", 2**30) if rows[-1][3] >= 2**30 else ("MiB", 2**20)
        xs = range(len(rows))
        for k, (label, shade) in enumerate((("model state", "#9ecae1"), ("step peak (bf16)", "#3182bd"))):
            values = [r[2 + k] / scale for r in rows]
            bars = right.bar([x + (k - 0.5) * 0.38 for x in xs], values, 0.38, color=shade, label=label)
            right.bar_label(bars, [f"{v:.3g}" + (f"\n{v / values[-1]:.0%}" if x < len(rows) - 1 else "")
                                   for x, v in enumerate(values)], fontsize=8)
        right.set_xticks(xs, [r[0] for r in rows])
        right.set(ylabel=unit, title=f"model state and step peak (% of vanilla), micro-batch "
                                     f"{tcfg.batch_size} x {tcfg.block_size}")
        right.legend(loc="upper left", fontsize=8)
        right.margins(y=0.15)
    fig.legend(handles=[Patch(color=color["T"], label="layer trains (full rank)"),
                        Patch(color=color["F"], label="layer frozen: int8 weight + LoRA adapter")],
               loc="upper center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    tmp = f"{args.plot}.tmp"   # never a half-written file under the name asked for
    fig.savefig(tmp, format=fmt, dpi=100)
    os.replace(tmp, args.plot)
    print(f"wrote {args.plot}")


def main(argv):
    p = argparse.ArgumentParser(prog="plan.py", description="STEP stage plan and memory table")
    p.add_argument("config", nargs="+", help="one config file or more")
    p.add_argument("--stages", type=int, default=0, help="K (default: 2 and 3, and the config's)")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank (default: the config's)")
    p.add_argument("--vocab", type=int, default=0,
                   help="vocabulary size (default: the config's data; 32000 for the paper's LLaMA tokenizer)")
    p.add_argument("--budget", type=float, default=0,
                   help="bytes of model state: the fewest stages that fit, then int8, 8-bit AdamW, ZeRO-1")
    p.add_argument("--world", type=int, default=8, help="ranks of the ZeRO-1 rows (1: leave them out)")
    p.add_argument("--layers_only", action="store_true", help="count the layers only, as the paper's Eq. 2-3")
    p.add_argument("--plot", default="", metavar="FILE",
                   help="draw each config's stages as set (.png, .svg, .pdf; needs matplotlib)")
    p.add_argument("--fsdp", action="store_true",
                   help="also the per-GPU table of DDP, ZeRO-1 and FSDP on --world GPUs (also printed for "
                        "a run that sets fsdp or zero1)")
    p.add_argument("--gpu_gb", type=float, default=GPU_BYTES / 1e9, help="GPU memory in GB, for that table")
    args, keys = p.parse_known_args(argv)
    args.keys = keys + ["--fsdp=True"] * args.fsdp   # the rest: train.py's --key=value overrides
    if args.plot:
        return plot(args)
    for i, config in enumerate(args.config):
        print("\n" * (i > 0), end="")
        plan_table(args, config)


if __name__ == "__main__":
    run_cli(main)
