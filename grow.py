"""STEP's two tools: the memory model with its stage planner, and the growth operators.

  python grow.py plan config/step_1b.py [--stages K] [--rank r] [--budget 6e9] [--world 8] [--layers_only]
  python grow.py CKPT --add N [--init mean|copy|zero|stack] [--where upper|...] [--freeze] --out OUT

Memory model (model states only, as in the paper's Eq. 1-3): a trainable parameter costs 16 bytes
(weight, gradient and the two AdamW moments; 2+2+12 in the paper's mixed precision, 4+4+8 with fp32
master weights under autocast: the same 16). A frozen parameter costs 2 bytes in the paper's bf16
accounting; in ours a frozen linear weight is int8 (1 byte) plus one fp32 scale per output row, and a
frozen norm weight stays fp32 (4 bytes). Unlike the paper we count every tensor: embeddings, head,
norms and adapters.
"""
import argparse
import copy
import itertools
import json
import math
import os
from dataclasses import asdict

import torch
import torch.nn as nn

from common import UserError, load_checkpoint, load_config, run_cli, save_checkpoint
from model import GPT, LINEARS, RESIDUAL_OUT, Block, GPTConfig, dense_weight, padded_vocab

INITS = ("mean", "copy", "zero", "stack")
PLACEMENTS = ("upper", "intermediate", "lower", "interleave", "random")
TRAINABLE_BYTES = 16


# ----------------------------------------------------------------------------------------------
# a run's stages

def check_stages(cfg):
    """The STEP keys of a run config (common.TrainConfig), checked before any work is done."""
    if cfg.grow_init not in INITS or cfg.grow_where not in PLACEMENTS:
        raise UserError(f"grow_init must be one of {INITS} and grow_where one of {PLACEMENTS}")
    if cfg.stage_layers and (any(not isinstance(n, int) or n < 0 for n in cfg.stage_layers) or cfg.stage_layers[0] < 1):
        raise UserError(f"stage_layers={cfg.stage_layers}: the first stage needs at least one layer, later ones 0 or more")
    if cfg.stage_layers and cfg.target_layers and sum(cfg.stage_layers) != cfg.target_layers:
        raise UserError(f"stage_layers={cfg.stage_layers} sum to {sum(cfg.stage_layers)}, "
                        f"not target_layers={cfg.target_layers}; fix one of them")
    if not cfg.stage_layers and cfg.n_stages > 1 and not cfg.target_layers:
        raise UserError("n_stages > 1 needs target_layers (planned) or stage_layers (explicit)")
    if cfg.target_layers and not cfg.stage_layers and cfg.n_stages > cfg.target_layers:
        raise UserError(f"n_stages={cfg.n_stages} must be between 1 and target_layers={cfg.target_layers}")
    if cfg.stage_tokens and len(cfg.stage_tokens) != stage_count(cfg):
        raise UserError(f"stage_tokens has {len(cfg.stage_tokens)} entries for {stage_count(cfg)} stages")
    if stage_count(cfg) > 1 and cfg.lora_rank > cfg.n_embd:
        raise UserError(f"lora_rank={cfg.lora_rank} must be between 0 (no adapters) and n_embd={cfg.n_embd}")


def stage_count(cfg):
    return len(cfg.stage_layers) or (cfg.n_stages if cfg.target_layers else 1)


def final_depth(cfg):
    return sum(cfg.stage_layers) or cfg.target_layers or cfg.n_layer


def model_config(cfg, n_layer, vocab_size):
    """The GPTConfig of an n_layer model of the run config cfg: every field both share comes from
    cfg (so a new model key reaches the model by being named in both). Embeddings start trainable:
    cfg.train_embeddings=False freezes them at the first growth."""
    return GPTConfig.from_dict(asdict(cfg), n_layer=n_layer, vocab_size=vocab_size, train_embeddings=True)


def stage_plan(cfg, vocab_size, tokens_per_iter):
    """-> (layers added per stage, iterations per stage) of the run config cfg."""
    check_stages(cfg)
    if cfg.stage_layers:
        layers = list(cfg.stage_layers)
    elif cfg.target_layers:
        layers = plan_stages(model_config(cfg, cfg.target_layers, vocab_size), cfg.target_layers, cfg.n_stages,
                             train_embeddings=cfg.train_embeddings)
    else:
        layers = [cfg.n_layer]
    if cfg.stage_tokens:
        iters = [max(1, math.ceil(t / tokens_per_iter)) for t in cfg.stage_tokens]
    else:
        k = len(layers)
        if cfg.max_iters < k:
            raise UserError(f"max_iters={cfg.max_iters} is fewer than the {k} stages")
        iters = [cfg.max_iters // k] * k
        iters[-1] += cfg.max_iters - sum(iters)
    # grow_at < 1 (our reading of the paper's "grow when 75% of each stage's steps are done"):
    # stage i ends after grow_at of its own budget; the steps it leaves go to the stages after it
    ends = [sum(iters[:i]) + round(cfg.grow_at * n) for i, n in enumerate(iters[:-1])] + [sum(iters)]
    starts = [0] + ends[:-1]
    iters = [max(1, e - s) for s, e in zip(starts, ends)]
    return layers, iters


# ----------------------------------------------------------------------------------------------
# memory model

def layer_shapes(cfg):
    """(out, in) of the seven linears of one layer."""
    d, f = cfg.n_embd, cfg.ffn_hidden
    return [(d, d)] * 4 + [(f, d), (f, d), (d, f)]


def layer_counts(cfg):
    """(linear weight elements, output rows, norm elements, adapter elements) of one layer."""
    shapes = layer_shapes(cfg)
    return (sum(n * k for n, k in shapes), sum(n for n, _ in shapes), 2 * cfg.n_embd,
            sum(cfg.lora_rank * (n + k) for n, k in shapes))


def outside_params(cfg):
    """Parameters outside the layer stack: embeddings, head (unless tied) and the final norm."""
    return cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2) + cfg.n_embd


def param_count(cfg):
    weights, _, norms, _ = layer_counts(cfg)
    return cfg.n_layer * (weights + norms) + outside_params(cfg)


def trainable_bytes(accounting, zero_world=1):
    """Bytes per trainable parameter: weight and gradient, plus the optimizer's share, which ZeRO-1
    divides over zero_world ranks (ours: fp32 AdamW moments, 8 B; the paper's mixed precision: bf16
    weight and gradient, fp32 master weight and moments, 12 B)."""
    sharded = 8 if accounting == "int8" else 12
    return TRAINABLE_BYTES - sharded + sharded / zero_world


ADAMW8BIT_MIN_SIZE, ADAMW8BIT_BLOCK = 4096, 256   # bitsandbytes' AdamW8bit defaults (min_8bit_size, blocksize)


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
    layer = [n * k for n, k in layer_shapes(cfg)] + [d, d]
    adapter = [cfg.lora_rank * m for shape in layer_shapes(cfg) for m in shape] if cfg.lora_rank else []
    outside = [cfg.vocab_size * d] * (1 if cfg.tie_embeddings else 2) + [d]
    return layer * n_trainable + adapter * n_frozen + (outside if not layers_only and (train_embeddings or n_frozen == 0)
                                                       else [])


def trainable_count(cfg, n_trainable, n_frozen, train_embeddings=True, layers_only=False):
    return sum(trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings, layers_only))


def state_bytes(cfg, n_trainable=None, n_frozen=None, accounting="int8", train_embeddings=True, layers_only=False,
                zero_world=1, optimizer="adamw"):
    """Model-state bytes of a model with n_frozen frozen (+ adapters) and n_trainable trainable
    layers; by default the split that `cfg.frozen_layers` describes. With zero_world > 1: per rank
    under ZeRO-1 (about: ZeRO shards whole tensors, so the ranks' shares differ a little).
    optimizer="adamw8bit" (our int8 accounting only): fp32 weight and gradient, 8-bit moments."""
    if n_frozen is None:
        n_frozen = len(cfg.frozen_layers)
        n_trainable = cfg.n_layer - n_frozen
    weights, rows, norms, _ = layer_counts(cfg)
    if optimizer == "adamw8bit":
        if accounting != "int8" or zero_world != 1:
            raise ValueError("adamw8bit is counted in the int8 accounting, without ZeRO-1 (train.py refuses both)")
        sizes = trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings, layers_only)
        total = sum(8 * n + adamw8bit_state_bytes(n) for n in sizes) + ADAMW8BIT_CODEBOOKS * (max(sizes) >= ADAMW8BIT_MIN_SIZE)
    else:
        total = trainable_bytes(accounting, zero_world) * trainable_count(cfg, n_trainable, n_frozen, train_embeddings,
                                                                           layers_only)
    if accounting == "int8":   # our fp32 training; the frozen store as the config keeps it
        store = 2 * weights if cfg.frozen_dtype == "bf16" else weights + 4 * rows
        frozen_layer = store + 4 * norms
    elif accounting == "bf16":
        frozen_layer = 2 * (weights + norms)
    else:
        raise ValueError(f"accounting {accounting!r}: use int8 or bf16")
    total += n_frozen * frozen_layer
    if not layers_only and not (train_embeddings or n_frozen == 0):
        total += outside_params(cfg) * (4 if accounting == "int8" else 2)   # a frozen embedding stays a float tensor
    return int(total)


def activation_bytes(cfg, tokens, n_trainable, n_frozen=0, checkpointing=False, loss_chunk=0):
    """What autograd holds for the backward of a micro-batch of `tokens` tokens through n_trainable
    trainable and n_frozen frozen layers, at the start of
    the backward (the step's peak when activations dominate), in fp32 (CPU, or dtype=float32; bf16
    autocast saves other tensors: measured on CUDA, not modelled). Per token, in elements:
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
    tests/test_grow.py checks this against the allocator within 10 %."""
    C, F, V, r = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size, cfg.lora_rank
    layer = 11 * C + 4 * F
    head = 3 * C + (4 * V * min(loss_chunk, tokens) / tokens if loss_chunk else 3 * V)
    if checkpointing:
        per_token = (n_trainable + n_frozen) * C + max(head, 10.5 * C + 7.5 * F + 7 * r * (n_frozen > 0))
    else:
        per_token = (n_trainable + n_frozen) * layer + n_frozen * 7 * r + head
    return int(4 * tokens * per_token)


def step_peak_bytes(cfg, n_trainable, n_frozen, tokens, train_embeddings=True, checkpointing=False, loss_chunk=0,
                    optimizer="adamw", zero_world=1):
    """The peak of one training step in our fp32 accounting, the larger of: the model state
    without the gradients (set to None after every step; they appear as the backward runs and its
    saved tensors go) plus the activations at the start of the backward; the full state at the
    optimizer step plus the optimizer's temporaries. foreach AdamW's: the square root of the second
    moments, at most the trainable parameters' size (measured 3/4 of it at step_small, so this side
    over-predicts). bitsandbytes' AdamW8bit on CPU works one tensor at a time in fp32: both moments
    dequantised, the gradient, the square root and the denominator, 5 copies of the largest tensor
    (its CUDA kernel updates in place, so there this side over-predicts). With zero_world > 1: per
    rank under ZeRO-1 (each rank steps its share; the gradients are whole on every rank)."""
    state = state_bytes(cfg, n_trainable, n_frozen, train_embeddings=train_embeddings, optimizer=optimizer,
                        zero_world=zero_world)
    sizes = trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings)
    grads = 4 * sum(sizes)
    act = activation_bytes(cfg, tokens, n_trainable, n_frozen, checkpointing, loss_chunk)
    temp = 5 * 4 * max(sizes) if optimizer == "adamw8bit" else grads / zero_world
    return int(max(state - grads + act, state + temp))


def stage_memory(cfg, stage_layers, **kw):
    """Model-state bytes of each stage: stage i trains n_i new layers next to N_{i-1} frozen ones."""
    done, out = 0, []
    for n in stage_layers:
        out.append(state_bytes(cfg, n_trainable=n, n_frozen=done, **kw))
        done += n
    return out


def plan_stages(cfg, target_layers, n_stages, **kw):
    """The layer counts n_1..n_K (sum L, all >= 1) that minimise the peak over stages (Eq. 3).
    Enumeration: C(L-1, K-1) splits, trivial for the K <= 4 and L <= 64 of practice. Ties go to the
    plan with the smaller sum of stage memories, then to the lexicographically largest."""
    if not 1 <= n_stages <= target_layers:
        raise UserError(f"n_stages={n_stages} must be between 1 and target_layers={target_layers}")
    best = None
    for cuts in itertools.combinations(range(1, target_layers), n_stages - 1):
        bounds = (0,) + cuts + (target_layers,)
        layers = [b - a for a, b in zip(bounds, bounds[1:])]
        mem = stage_memory(cfg, layers, **kw)
        key = (max(mem), sum(mem), [-n for n in layers])
        if best is None or key < best[0]:
            best = (key, layers)
    return best[1]


def settings(world=8):
    """The model-state accountings the plan compares: (name, state_bytes keywords). The paper's
    (bf16 mixed precision) and ours: int8 frozen store with fp32 AdamW, with 8-bit AdamW
    (optimizer=adamw8bit), and with ZeRO-1 over `world` ranks (zero1=True; per rank)."""
    out = [("paper bf16", dict(accounting="bf16")), ("int8", dict(accounting="int8")),
           ("int8 + 8-bit AdamW", dict(accounting="int8", optimizer="adamw8bit"))]
    return out + ([(f"int8 + ZeRO-1 / {world}", dict(accounting="int8", zero_world=world))] if world > 1 else [])


def smallest_plan(cfg, target_layers, budget, choices, max_stages=8, **kw):
    """The cheapest plan whose model-state peak fits `budget` bytes: the fewest stages (the least
    change to training), then the first of `choices` ((name, state_bytes keywords), in the order
    we would rather run them). -> (K, name, layers, peak)."""
    best = None
    for k in range(1, min(max_stages, target_layers) + 1):
        for name, ckw in choices:
            layers = plan_stages(cfg, target_layers, k, **ckw, **kw)
            peak = max(stage_memory(cfg, layers, **ckw, **kw))
            if peak <= budget:
                return k, name, layers, peak
            best = min(best or peak, peak)
    raise UserError(f"no plan of up to {min(max_stages, target_layers)} stages fits {budget / 2**30:.2f} GiB "
                    f"(the best needs {best / 2**30:.2f} GiB of model state); raise the budget or lower lora_rank")


def cpu_memory_timeline(fn):
    """Run fn() and record the CPU tensor memory it allocates, from the profiler's record of every
    allocation and free (not from a list of tensors we think exist). -> [(time.time_ns(), bytes
    live)], one entry per event. The timeline is a private torch API (torch 2.13); CUDA has
    torch.cuda.max_memory_allocated instead."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
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
# growth operators

def insertion_gaps(n_old, n_new, where, seed=0):
    """For each new layer, the old layer it goes right above (sorted).

    The paper's ablation compares upper, intermediate, lower and random placement without defining
    the regions; ours split the old stack's gaps (one above each old layer, the topmost above the
    top layer) into thirds, so the three regions are apart at any depth of 3 or more. The new layers
    spread evenly over their region's gaps, several per gap where there are more new layers than
    gaps, the surplus towards the top. 'interleave' spreads them over every gap (LLaMA-Pro's block
    expansion), 'random' puts each into a gap drawn uniformly (seeded)."""
    if where == "random":
        return sorted(torch.randint(n_old, (n_new,), generator=torch.Generator().manual_seed(seed)).tolist())
    if where not in PLACEMENTS:
        raise UserError(f"where={where!r}: use one of {PLACEMENTS}")
    size = n_old if where == "interleave" else max(1, math.ceil(n_old / 3))
    first = {"upper": n_old - size, "intermediate": (n_old - size) // 2}.get(where, 0)
    return [first + min(size - 1, ((j + 1) * size - 1) // n_new) for j in range(n_new)]


def _new_block(cfg, sources, weights, init):
    """A trainable block whose tensors are the weighted sum of the source blocks' (dense) tensors."""
    block = Block(cfg)
    with torch.no_grad():
        for name in LINEARS:
            block.linear(name).weight.copy_(sum(w * dense_weight(s.linear(name)) for s, w in zip(sources, weights)))
            if init == "zero" and name in RESIDUAL_OUT:
                block.linear(name).weight.zero_()   # the block adds nothing to the residual stream
        for norm in ("attn_norm", "mlp_norm"):
            getattr(block, norm).weight.copy_(sum(w * getattr(s, norm).weight for s, w in zip(sources, weights)))
    return block.to(sources[0].attn_norm.weight.device)


def grow(model, n_new, init="mean", where="upper", seed=0):
    """Insert n_new trainable layers into model in place; returns their indices in the new stack.
    mean (the paper's Interpolation-Mean): one new layer between old layers i and i+1 is their mean;
    k new layers in that gap interpolate, the j-th = (1 - j/(k+1)) layer i + j/(k+1) layer i+1;
    above the top layer, copies of it. copy: copies of the layer below; zero: copy with
    attention-out and MLP-down zeroed, so the grown model computes exactly the small model's
    function; stack: layers 0..n_new-1 repeated on top (G_stack; n_new = L doubles the stack),
    `where` is ignored."""
    if init not in INITS:
        raise UserError(f"init={init!r}: use one of {INITS}")
    if n_new < 1:
        raise UserError(f"add at least one layer (got {n_new})")
    old = list(model.layers)
    L = len(old)
    cfg = copy.copy(model.config)
    cfg.n_layer = L + n_new
    order = []   # (old index, None) for kept layers, (None, block) for new ones
    if init == "stack":
        order = [(i, None) for i in range(L)] + [(None, _new_block(cfg, [old[j % L]], [1.0], "copy")) for j in range(n_new)]
    else:
        gaps = insertion_gaps(L, n_new, where, seed)
        for i in range(L):
            order.append((i, None))
            k = gaps.count(i)
            for j in range(1, k + 1):
                t = j / (k + 1) if init == "mean" and i + 1 < L else 0.0
                order.append((None, _new_block(cfg, [old[i], old[min(i + 1, L - 1)]], [1 - t, t], init)))
    frozen = set(model.config.frozen_layers)
    cfg.frozen_layers = tuple(k for k, (i, _) in enumerate(order) if i is not None and i in frozen)
    new_idx = [k for k, (i, _) in enumerate(order) if i is None]
    model.layers = nn.ModuleList(old[i] if i is not None else b for i, b in order)
    model.config = cfg
    return new_idx


def next_stage(model, n_new, init="mean", where="upper", seed=0, train_embeddings=True, rounding="nearest"):
    """STEP's stage transition: merge the adapters of already-frozen layers into their int8 weights
    (and restart them), grow n_new layers, freeze every layer that is not new (and, unless
    train_embeddings, the embeddings, final norm and head). Every random draw (placement, new
    adapters, stochastic rounding) comes from `seed`, so all ranks make the same ones.
    -> (indices of the new layers, MergeStats of the merge, or None when nothing was merged)."""
    g = torch.Generator().manual_seed(seed)
    merged = sum(model.layers[i].merge_adapters(rounding, g) for i in model.config.frozen_layers) or None
    new_idx = grow(model, n_new, init, where, seed) if n_new else []   # 0: freeze only (ReLoRA's second phase)
    cfg = model.config
    for i, block in enumerate(model.layers):
        if i not in new_idx and not block.frozen:
            block.freeze(cfg.lora_rank, cfg.lora_alpha, g, cfg.frozen_dtype)
    cfg.frozen_layers = tuple(i for i in range(cfg.n_layer) if i not in new_idx)
    if not train_embeddings:
        model.freeze_embeddings()
    return new_idx, merged


# ----------------------------------------------------------------------------------------------
# CLI

def data_vocab(cfg, override=0):
    """-> (the model's padded vocabulary, where the number comes from): --vocab, else the prepared
    data's meta.json, else the config's vocab_size, else data/prepare.py's default tokenizer, said
    as an assumption."""
    if override:
        return padded_vocab(override), f"--vocab {override}"
    meta = os.path.join(cfg.data_dir, "meta.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            n = check_vocab(cfg, json.load(f)["vocab_size"])
        return padded_vocab(n), f"{n} tokens in {meta}"
    if cfg.vocab_size:
        return padded_vocab(cfg.vocab_size), f"{cfg.vocab_size} tokens, the config's vocab_size"
    from data.prepare import DEFAULT_VOCAB_RANKS
    n = DEFAULT_VOCAB_RANKS + 1
    return padded_vocab(n), (f"{n} tokens assumed: {cfg.data_dir} is not prepared and data/prepare.py's default "
                             f"tokenizer has {n}; --vocab N for another")


def check_vocab(cfg, data_vocab_size):
    if cfg.vocab_size and cfg.vocab_size != data_vocab_size:
        raise UserError(f"{cfg.data_dir} holds a {data_vocab_size}-token vocabulary but the config is for "
                        f"vocab_size={cfg.vocab_size}: prepare the data with --vocab_ranks={cfg.vocab_size - 1}, "
                        f"or set --vocab_size=0")
    return data_vocab_size


def _plan_cli(args):
    tcfg = load_config([args.config] + ([f"--lora_rank={args.rank}"] if args.rank else []))
    check_stages(tcfg)
    target = final_depth(tcfg)
    vocab, source = data_vocab(tcfg, args.vocab)
    cfg = model_config(tcfg, target, vocab)
    emb = tcfg.train_embeddings
    act = dict(checkpointing=tcfg.activation_checkpointing, loss_chunk=tcfg.loss_chunk)
    lean = dict(checkpointing=True, loss_chunk=tcfg.block_size)
    tokens = tcfg.batch_size * tcfg.block_size
    scope = "the layers only, as the paper's Eq. 2-3" if args.layers_only else "every tensor"
    vanilla = state_bytes(cfg, target, 0, layers_only=args.layers_only)   # 16 B per parameter
    print(f"{args.config}: {target} layers, n_embd {cfg.n_embd}, ffn {cfg.ffn_hidden}, vocab {cfg.vocab_size} "
          f"({source}), {param_count(cfg) / 1e6:.1f}M parameters, lora rank {cfg.lora_rank}, embeddings "
          f"{'trainable' if emb else 'frozen'} in later stages")
    full_vanilla = [step_peak_bytes(cfg, target, 0, tokens, **a) / 2**30 for a in (act, lean)]
    print(f"vanilla (every parameter trained, fp32 AdamW state: 16 B each): {vanilla / 2**30:.3f} GiB of model "
          f"state, counting {scope}; full peak {full_vanilla[0]:.2f} GiB, ckpt+chunk {full_vanilla[1]:.2f} GiB")
    print(f"full peak: the peak stage's training step with activations in fp32 at micro-batch {tcfg.batch_size} x "
          f"{tcfg.block_size} (activation_checkpointing={tcfg.activation_checkpointing}, loss_chunk={tcfg.loss_chunk}; "
          f"every tensor; bf16 autocast on CUDA saves less); 'ckpt+chunk': the same with activation_checkpointing=True "
          f"and loss_chunk={tcfg.block_size}\n")
    stages = [args.stages] if args.stages else sorted({k for k in (2, 3, 4, stage_count(tcfg)) if 1 < k <= target})
    print(f"{'setting':<22} {'K':>2}  {'layers':<18} {'stage state (GiB)':<30} {'peak GiB':>8}  "
          f"{'vs vanilla':>10}  {'vs vanilla, same setting':>24}  {'full peak GiB':>13} {'ckpt+chunk':>10}")
    for name, skw in settings(args.world):
        same = state_bytes(cfg, target, 0, layers_only=args.layers_only, **skw)
        for k in stages:
            layers = plan_stages(cfg, target, k, train_embeddings=emb, layers_only=args.layers_only, **skw)
            mem = stage_memory(cfg, layers, train_embeddings=emb, layers_only=args.layers_only, **skw)
            full = f"{'-':>13} {'-':>10}"   # the paper's bf16 activations: not modelled
            if skw["accounting"] == "int8":
                frozen = [sum(layers[:i]) for i in range(k)]
                opt = {key: v for key, v in skw.items() if key != "accounting"}
                peaks = [max(step_peak_bytes(cfg, n, f, tokens, emb or f == 0, **a, **opt) for n, f in zip(layers, frozen))
                         for a in (act, lean)]
                full = f"{peaks[0] / 2**30:13.2f} {peaks[1] / 2**30:10.2f}"
            print(f"{name:<22} {k:>2}  {str(layers):<18} {' '.join(f'{m / 2**30:.2f}' for m in mem):<30} "
                  f"{max(mem) / 2**30:8.2f}  {-100 * (1 - max(mem) / vanilla):9.1f}%  {-100 * (1 - max(mem) / same):23.1f}%"
                  f"  {full}")
    if args.budget:
        choices = [c for c in settings(args.world) if c[0] != "paper bf16"]
        k, name, layers, peak = smallest_plan(cfg, target, args.budget, choices, train_embeddings=emb,
                                              layers_only=args.layers_only)
        keys = {"int8": "", "int8 + 8-bit AdamW": " --optimizer=adamw8bit"}.get(name, f" --zero1=True on {args.world} ranks")
        print(f"\nbudget {args.budget / 2**30:.2f} GiB of model state: the cheapest plan that fits is K = {k} with "
              f"{name}, layers {layers}, {peak / 2**30:.2f} GiB (train with --stage_layers={layers}{keys})")


def _grow_cli(args):
    ckpt = load_checkpoint(args.ckpt)
    model = GPT.from_checkpoint(ckpt, args.ckpt)
    before = model.config.n_layer
    if args.freeze:
        new_idx, _ = next_stage(model, args.add, args.init, args.where, seed=args.seed)
    else:
        new_idx = grow(model, args.add, args.init, args.where, seed=args.seed)
    save_checkpoint(args.out, {"model": model.state_dict(), "model_args": asdict(model.config),
                               "grown_from": args.ckpt, "meta": ckpt.get("meta"), "config": ckpt.get("config", {})})
    tr, fr = model.num_params()
    print(f"grew {args.ckpt} from {before} to {model.config.n_layer} layers ({args.init}, {args.where}); new layers "
          f"{new_idx}; frozen {list(model.config.frozen_layers)}; trainable {tr:,}, frozen {fr:,}; wrote {args.out} "
          f"(train from it with --init_from={args.out})")


def main(argv):
    if argv[:1] == ["plan"]:
        p = argparse.ArgumentParser(prog="grow.py plan", description="STEP stage plan and memory table")
        p.add_argument("config")
        p.add_argument("--stages", type=int, default=0, help="K (default: 2 and 3, and the config's)")
        p.add_argument("--rank", type=int, default=0, help="LoRA rank (default: the config's)")
        p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the config's data, e.g. 32000 for the paper's LLaMA tokenizer)")
        p.add_argument("--budget", type=float, default=0,
                       help="bytes of model state: the fewest stages that fit, then int8, 8-bit AdamW, ZeRO-1")
        p.add_argument("--world", type=int, default=8, help="ranks of the ZeRO-1 rows (1: leave them out)")
        p.add_argument("--layers_only", action="store_true", help="count the layers only, as the paper's Eq. 2-3")
        return _plan_cli(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="grow.py", description="grow a checkpoint in depth")
    p.add_argument("ckpt")
    p.add_argument("--add", type=int, required=True, help="number of layers to insert")
    p.add_argument("--init", default="mean", choices=INITS)
    p.add_argument("--where", default="upper", choices=PLACEMENTS)
    p.add_argument("--freeze", action="store_true", help="STEP transition: freeze old layers in int8 + LoRA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    _grow_cli(p.parse_args(argv))


if __name__ == "__main__":
    run_cli(main)
