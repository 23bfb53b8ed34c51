"""The memory model beyond the paper's Eq. 1-3 (grow.py): 8-bit AdamW state, ZeRO-1, the
activations autograd saves, the peak of a whole training step, the cheapest plan under a budget;
and the plan table of a config.

  python plan.py config/step_1b.py [--stages K] [--rank r] [--budget 6e9] [--world 8] [--layers_only]

Counts are in our fp32 accounting unless an `accounting` says "bf16" (the paper's). bench/memory.py
measures what these functions predict (the allocator on CPU, max_memory_allocated on CUDA).
"""
import argparse
import math
import os

import grow
from data.load import check_vocab, read_meta
from model import padded_vocab
from stepgpt.config import load_config
from stepgpt.errors import UserError

def trainable_bytes(accounting, zero_world=1):
    """Bytes per trainable parameter: weight and gradient, plus the optimizer's share, which ZeRO-1
    divides over zero_world ranks (ours: fp32 AdamW moments, 8 B; the paper's mixed precision: bf16
    weight and gradient, fp32 master weight and moments, 12 B)."""
    sharded = 8 if accounting == "int8" else 12
    return grow.TRAINABLE_BYTES - sharded + sharded / zero_world


# bitsandbytes' AdamW8bit defaults (min_8bit_size, blocksize)
ADAMW8BIT_MIN_SIZE, ADAMW8BIT_BLOCK = 4096, 256
ADAMW8BIT_CODEBOOKS = 2 * 256 * 4                   # its two fp32 quantisation maps, one pair per optimizer


def adamw8bit_state_bytes(numel):
    """bitsandbytes' AdamW8bit state of one tensor: two uint8 moments and one fp32 absmax per block
    of 256 entries for each; tensors under 4,096 entries keep fp32 moments (8 B each). The two code
    books (ADAMW8BIT_CODEBOOKS) are shared by all tensors."""
    if numel < ADAMW8BIT_MIN_SIZE:
        return 8 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / ADAMW8BIT_BLOCK)


def trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings=True, layers_only=False):
    """The sizes (elements) of the trainable tensors: the trainable layers' linears and norms, the
    frozen layers' adapters A and B and, unless frozen (train_embeddings=False after the first
    stage) or left out, embeddings, head and final norm."""
    d = cfg.n_embd
    layer = [n * k for n, k in grow.layer_shapes(cfg)] + [d, d]
    adapter = [cfg.lora_rank * m for shape in grow.layer_shapes(cfg) for m in shape] if cfg.lora_rank else []
    outside = [cfg.vocab_size * d] * (1 if cfg.tie_embeddings else 2) + [d]
    keep_outside = not layers_only and (train_embeddings or n_frozen == 0)
    return layer * n_trainable + adapter * n_frozen + (outside if keep_outside else [])


def state_bytes(cfg, n_trainable=None, n_frozen=None, accounting="int8", train_embeddings=True,
                layers_only=False, zero_world=1, optimizer="adamw"):
    """grow.state_bytes with the optimizer's state as it is run: with zero_world > 1 per rank under
    ZeRO-1 (about: ZeRO shards whole tensors, so the ranks' shares differ a little);
    optimizer="adamw8bit" (our int8 accounting only): fp32 weight and gradient, 8-bit moments."""
    if n_frozen is None:
        n_frozen = len(cfg.frozen_layers)
        n_trainable = cfg.n_layer - n_frozen
    args = (cfg, n_trainable, n_frozen, accounting, train_embeddings, layers_only)
    if optimizer != "adamw8bit":
        return grow.state_bytes(*args, per_trainable=trainable_bytes(accounting, zero_world))
    if accounting != "int8" or zero_world != 1:
        raise ValueError("adamw8bit is counted in the int8 accounting, without ZeRO-1 (train.py refuses "
                         "both)")
    sizes = trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings, layers_only)
    books = ADAMW8BIT_CODEBOOKS * (max(sizes) >= ADAMW8BIT_MIN_SIZE)
    moments = sum(8 * n + adamw8bit_state_bytes(n) for n in sizes)   # fp32 weight and gradient, 8-bit moments
    return grow.state_bytes(*args, per_trainable=0) + moments + books


def activation_bytes(cfg, tokens, n_trainable, n_frozen=0, checkpointing=False, loss_chunk=0,
                     dtype="float32"):
    """What autograd holds for the backward of a micro-batch of `tokens` tokens through n_trainable
    trainable and n_frozen frozen layers, at the start of the backward (the step's peak when
    activations dominate). dtype "float32" (CPU, or dtype=float32), per token, in elements:
      a layer: 11C + 4F: each RMSNorm its input, input * rstd and output (3C, twice); q and k after
        RoPE, v, the SDPA output and its (T, C) copy for the o projection (5C); SwiGLU's gate,
        silu(gate), up and their product (4F); a frozen layer adds x A^T of its seven linears (7r);
      the head: the final norm (3C), the log-softmax the loss saves and, in the backward, its
        gradient and the logits' (3V; train.py keeps no name for the logits themselves).
    Activation checkpointing keeps a layer's input (C) and recomputes one layer at a time in the
    backward, whose peak, the recomputed activations with the gradients of them, is 10.5C + 7.5F
    (fitted to the allocator at C in {192, 384}, F in {512, 1024}, within 2 %: 13C + 4F, the
    activations and two gradients, fell 10-18 % short where the chunked loss stopped hiding it).
    loss_chunk holds 4V (the recomputed logits too) for loss_chunk tokens instead of 3V for all.
    tests/test_grow.py checks this against the allocator within 10 %.
    dtype "bfloat16" (bf16 autocast on CUDA), per token, in bytes: the residual stream stays fp32
    (each norm's input, 4C twice); every linear saves its own bf16 copy of its input (q, k, v: 6C;
    gate, up: 4C); q and k before RoPE and after, and v (10C); the SDPA output and its copy for o
    (4C); SwiGLU's four bf16 tensors (8F); a frozen layer's x A^T (7 x 2r). The head: the final
    norm and the lm_head's input copy (6C), the fp32 log-softmax, its gradient and the logits'
    gradient in fp32 and bf16 (14V). Checkpointing keeps each layer's fp32 input (4C) and, at the
    recomputed layer, its activations and their gradients (44C + 16F). Derived from what each op
    saves, not fitted: bench/memory.py --device cuda measures it (bench/RESULTS.md)."""
    C, F, V, r = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size, cfg.lora_rank
    layers, share = n_trainable + n_frozen, min(loss_chunk, tokens) / tokens if loss_chunk else 1
    if dtype == "float32":
        layer, frozen, head, kept = 4 * (11 * C + 4 * F), 4 * 7 * r, 4 * 3 * C, 4 * C
        redo = 4 * (10.5 * C + 7.5 * F)
        loss = 4 * (4 * V * share if loss_chunk else 3 * V)
    else:
        layer, frozen, head, kept, redo = 32 * C + 8 * F, 2 * 7 * r, 6 * C, 4 * C, 44 * C + 16 * F
        loss = 16 * V * share if loss_chunk else 14 * V
    if checkpointing:
        per_token = layers * kept + max(head + loss, redo + frozen * (n_frozen > 0))
    else:
        per_token = layers * layer + n_frozen * frozen + head + loss
    return int(tokens * per_token)


def step_peak_bytes(cfg, n_trainable, n_frozen, tokens, train_embeddings=True, checkpointing=False,
                    loss_chunk=0, optimizer="adamw", zero_world=1, dtype="float32"):
    """The peak of one training step, the larger of: the model state without the gradients (set to
    None after every step; they appear as the backward runs and its saved tensors go) plus the
    activations at the start of the backward; the full state at the optimizer step plus the
    optimizer's temporaries. foreach AdamW's: the square root of the second moments, at most the
    trainable parameters' size (measured 3/4 of it at step_small, so this side over-predicts).
    bitsandbytes' AdamW8bit on CPU works one tensor at a time in fp32: both moments dequantised, the
    gradient, the square root and the denominator, 5 copies of the largest tensor (its CUDA kernel
    updates in place, so there this side over-predicts). With zero_world > 1: per rank under ZeRO-1
    (each rank steps its share; the gradients are whole on every rank). dtype "bfloat16" (bf16
    autocast): bf16 activations (activation_bytes), and autocast's bf16 copies of the trainable
    linears' weights and of the head's, which the backward holds (2 B each)."""
    state = state_bytes(cfg, n_trainable, n_frozen, train_embeddings=train_embeddings, optimizer=optimizer,
                        zero_world=zero_world)
    sizes = trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings)
    grads = 4 * sum(sizes)
    act = activation_bytes(cfg, tokens, n_trainable, n_frozen, checkpointing, loss_chunk, dtype)
    if dtype == "bfloat16":
        act += 2 * (n_trainable * grow.layer_counts(cfg)[0] + cfg.vocab_size * cfg.n_embd)
    temp = 5 * 4 * max(sizes) if optimizer == "adamw8bit" else grads / zero_world
    return int(max(state - grads + act, state + temp))


def configured_peaks(tcfg, cfg, stage_layers, dtype):
    """The step peak of each stage of the run config tcfg as it is configured (micro-batch,
    checkpointing, chunked loss, optimizer) for the final model cfg, in `dtype` ("bfloat16": bf16
    autocast, how a CUDA run trains)."""
    optimizer = "adamw8bit" if tcfg.optimizer == "adamw8bit" else "adamw"   # GaLore as the AdamW it wraps
    frozen = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    return [step_peak_bytes(cfg, n, f, tcfg.batch_size * tcfg.block_size, tcfg.train_embeddings or f == 0,
                            tcfg.activation_checkpointing, tcfg.loss_chunk, optimizer=optimizer, dtype=dtype)
            for n, f in zip(stage_layers, frozen)]


GPU_BYTES = 80e9   # the GPUs the shipped configs are for (H100/A100 80 GB), of which 10 % stay free


def settings(world=8):
    """The model-state accountings the plan compares: (name, state_bytes keywords). The paper's
    (bf16 mixed precision) and ours: int8 frozen store with fp32 AdamW, with 8-bit AdamW
    (optimizer=adamw8bit), and with ZeRO-1 over `world` ranks (zero1=True; per rank)."""
    out = [("paper bf16", dict(accounting="bf16")), ("int8", dict(accounting="int8")),
           ("int8 + 8-bit AdamW", dict(accounting="int8", optimizer="adamw8bit"))]
    zero = [(f"int8 + ZeRO-1 / {world}", dict(accounting="int8", zero_world=world))]
    return out + (zero if world > 1 else [])


def smallest_plan(cfg, target_layers, budget, choices, max_stages=8, **kw):
    """The cheapest plan whose model-state peak fits `budget` bytes: the fewest stages (the least
    change to training), then the first of `choices` ((name, state_bytes keywords), in the order
    we would rather run them). -> (K, name, layers, peak)."""
    best = None
    for k in range(1, min(max_stages, target_layers) + 1):
        for name, ckw in choices:
            layers = grow.plan_stages(cfg, target_layers, k, state_bytes, **ckw, **kw)
            peak = max(grow.stage_memory(cfg, layers, state_bytes, **ckw, **kw))
            if peak <= budget:
                return k, name, layers, peak
            best = min(best or peak, peak)
    raise UserError(f"no plan of up to {min(max_stages, target_layers)} stages fits {budget / 2**30:.2f} "
                    f"GiB (the best needs {best / 2**30:.2f} GiB of model state); raise the budget or lower "
                    f"lora_rank")


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


def measure_cpu_memory(fn):
    """-> (peak bytes, bytes still allocated when fn returns) of fn()'s CPU tensor allocations."""
    timeline = cpu_memory_timeline(fn)
    return max(b for _, b in timeline), timeline[-1][1]




# ----------------------------------------------------------------------------------------------
# the plan table of a config (python plan.py CONFIG)

def data_vocab(cfg, override=0):
    """-> (the model's padded vocabulary, where the number comes from): --vocab, else the prepared
    data's meta.json, else the config's vocab_size, else data/prepare.py's default tokenizer, said
    as an assumption."""
    if override:
        return padded_vocab(override), f"--vocab {override}"
    if os.path.isfile(os.path.join(cfg.data_dir, "meta.json")):
        n = check_vocab(cfg.vocab_size, read_meta(cfg.data_dir), cfg.data_dir)
        return padded_vocab(n), f"{n} tokens in {os.path.join(cfg.data_dir, 'meta.json')}"
    if cfg.vocab_size:
        return padded_vocab(cfg.vocab_size), f"{cfg.vocab_size} tokens, the config's vocab_size"
    from data.prepare import DEFAULT_VOCAB_RANKS
    n = DEFAULT_VOCAB_RANKS + 1
    return padded_vocab(n), (f"{n} tokens assumed: {cfg.data_dir} is not prepared and data/prepare.py's "
                             f"default tokenizer has {n}; --vocab N for another")
def plan_table(args):
    tcfg = load_config([args.config] + ([f"--lora_rank={args.rank}"] if args.rank else []))
    target = grow.final_depth(tcfg)
    vocab, source = data_vocab(tcfg, args.vocab)
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
    plan_table(p.parse_args(argv))

