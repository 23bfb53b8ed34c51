"""The STEP stage plan and memory table of a config: Eq. 3's stages in the paper's accounting and in
ours (int8 store, 8-bit AdamW, ZeRO-1), each stage's model state and the peak of a training step
(the memory model: grow.py's Eq. 1-3 and stepgpt/memory.py). With --fsdp (or a run that sets fsdp
or zero1), also what each of --world GPUs holds under DDP, ZeRO-1 and FSDP, stage by stage.

  python plan.py config/step_1b.py [--stages K] [--rank r] [--budget 6e9] [--world 8] [--layers_only]
  python plan.py config/step_7b.py --world 2 --fsdp --gpu_gb 24 [--batch_size=1 ...: train.py's keys]
"""
import argparse

import grow
from data.load import padded_vocab, planned_vocab
from stepgpt.config import load_config
from stepgpt.errors import run_cli
from stepgpt.memory import (GPU_BYTES, configured_peaks, settings, sharded_state, smallest_plan, state_bytes,
                            step_peak_bytes)


def plan_table(args):
    tcfg = load_config([args.config] + ([f"--lora_rank={args.rank}"] if args.rank else []) + args.keys)
    target = grow.final_depth(tcfg)
    vocab, source = ((padded_vocab(args.vocab), f"--vocab {args.vocab}") if args.vocab
                     else planned_vocab(tcfg.data_dir, tcfg.vocab_size))
    cfg = grow.model_config(tcfg, target, vocab)
    emb, only = tcfg.train_embeddings, args.layers_only
    act = dict(checkpointing=tcfg.activation_checkpointing, loss_chunk=tcfg.loss_chunk)
    lean = dict(checkpointing=True, loss_chunk=tcfg.block_size)
    tokens = tcfg.batch_size * tcfg.block_size
    scope = "the layers only, as the paper's Eq. 2-3" if only else "every tensor"
    vanilla = state_bytes(cfg, target, 0, layers_only=only)   # 16 B per parameter
    gib = 2**30
    print(f"{args.config}: {target} layers, n_embd {cfg.n_embd}, ffn {cfg.ffn_hidden}, vocab "
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
    if args.budget:
        choices = [c for c in settings(args.world) if c[0] != "paper bf16"]
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
    (the one optimizer ZeRO-1 and FSDP shard here)."""
    gib, budget = 2**30, 0.9 * gpu_gb * 1e9
    act = dict(checkpointing=tcfg.activation_checkpointing, loss_chunk=tcfg.loss_chunk, dtype="bfloat16")
    print(f"\nper GPU on {world} ranks, GiB (AdamW fp32 state, bf16 autocast, micro-batch {tcfg.batch_size} "
          f"x {tcfg.block_size}, activation_checkpointing={tcfg.activation_checkpointing}, loss_chunk="
          f"{tcfg.loss_chunk}); a {gpu_gb:g} GB GPU keeps 10 % free below {budget / gib:.1f} GiB")
    print(f"{'stage':<6} {'layers':<10} {'setting':<10} {'weights':>8} {'grads':>8} {'AdamW':>8} "
          f"{'state':>8} {'step peak':>10}  fits")
    frozen = 0
    for i, n in enumerate(layers):
        emb = tcfg.train_embeddings or frozen == 0
        for mode in ("ddp", "zero1", "fsdp"):
            parts = sharded_state(cfg, n, frozen, world, mode, emb)
            shard = {"zero1": dict(zero_world=world), "fsdp": dict(fsdp_world=world)}.get(mode, {})
            peak = step_peak_bytes(cfg, n, frozen, tcfg.batch_size * tcfg.block_size, emb, **act, **shard)
            name = {"ddp": "DDP", "zero1": f"ZeRO-1/{world}", "fsdp": f"FSDP/{world}"}[mode]
            print(f"{i + 1:<6} {f'{n} + {frozen}':<10} {name:<10} "
                  + " ".join(f"{b / gib:8.2f}" for b in (*parts, sum(parts)))
                  + f" {peak / gib:10.2f}  {'yes' if peak <= budget else 'no'}")
        frozen += n


def main(argv):
    p = argparse.ArgumentParser(prog="plan.py", description="STEP stage plan and memory table")
    p.add_argument("config")
    p.add_argument("--stages", type=int, default=0, help="K (default: 2 and 3, and the config's)")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank (default: the config's)")
    p.add_argument("--vocab", type=int, default=0,
                   help="vocabulary size (default: the config's data; 32000 for the paper's LLaMA tokenizer)")
    p.add_argument("--budget", type=float, default=0,
                   help="bytes of model state: the fewest stages that fit, then int8, 8-bit AdamW, ZeRO-1")
    p.add_argument("--world", type=int, default=8, help="ranks of the ZeRO-1 rows (1: leave them out)")
    p.add_argument("--layers_only", action="store_true", help="count the layers only, as the paper's Eq. 2-3")
    p.add_argument("--fsdp", action="store_true",
                   help="also the per-GPU table of DDP, ZeRO-1 and FSDP on --world GPUs (also printed for "
                        "a run that sets fsdp or zero1)")
    p.add_argument("--gpu_gb", type=float, default=GPU_BYTES / 1e9, help="GPU memory in GB, for that table")
    args, keys = p.parse_known_args(argv)
    args.keys = keys + ["--fsdp=True"] * args.fsdp   # the rest: train.py's --key=value overrides
    plan_table(args)


if __name__ == "__main__":
    run_cli(main)
