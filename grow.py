"""STEP itself: the stage plan (the paper's Eq. 1-3), the growth operators, and the transition from
one stage to the next (merge, grow, freeze, and which optimizer state carries over).

  python grow.py CKPT --add N [--init mean|copy|zero|stack] [--where upper|...] [--freeze] --out OUT

Memory model (model states only, as in the paper's Eq. 1-3): a trainable parameter costs 16 bytes
(weight, gradient and the two AdamW moments; 2+2+12 in the paper's mixed precision, 4+4+8 with fp32
master weights under autocast: the same 16). A frozen parameter costs 2 bytes in the paper's bf16
accounting; in ours a frozen linear weight is int8 (1 byte) plus one fp32 scale per output row, and
a frozen norm weight stays fp32 (4 bytes). Unlike the paper we count every tensor: embeddings, head,
norms and adapters. stepgpt/memory.py extends this to activations, 8-bit AdamW, ZeRO-1 and the peak
of a whole training step (python plan.py CONFIG prints the tables).
"""
import argparse
import itertools
import math
from dataclasses import asdict, replace

import torch
import torch.nn as nn

from model import GPT, LINEARS, RESIDUAL_OUT, Block, GPTConfig, dense_weight
from stepgpt.checkpoint import load_checkpoint, new_file, save_checkpoint
from stepgpt.errors import UserError, run_cli

INITS = ("mean", "copy", "zero", "stack")
PLACEMENTS = ("upper", "intermediate", "lower", "interleave", "random")
TRAINABLE_BYTES = 16

# ----------------------------------------------------------------------------------------------
# a run's stages


def stage_count(cfg):
    return len(cfg.stage_layers) or (cfg.n_stages if cfg.target_layers else 1)


def final_depth(cfg):
    return sum(cfg.stage_layers) or cfg.target_layers or cfg.n_layer


def model_config(cfg, n_layer, vocab_size):
    """The GPTConfig of an n_layer model of the run config cfg. Embeddings start trainable:
    cfg.train_embeddings=False freezes them at the first growth."""
    return GPTConfig.from_dict(asdict(cfg), n_layer=n_layer, vocab_size=vocab_size, frozen_layers=(),
                               train_embeddings=True)


def stage_plan(cfg, vocab_size, tokens_per_iter):
    """-> (layers added per stage, iterations per stage) of the run config cfg."""
    if cfg.stage_layers:
        layers = list(cfg.stage_layers)
    elif cfg.target_layers:
        layers = plan_stages(model_config(cfg, cfg.target_layers, vocab_size), cfg.target_layers,
                             cfg.n_stages, train_embeddings=cfg.train_embeddings)
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
    return layers, [max(1, e - s) for s, e in zip(starts, ends)]


# ----------------------------------------------------------------------------------------------
# memory model (Eq. 1-2) and the stage plan that minimises its peak (Eq. 3)

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


def trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings=True, layers_only=False):
    """The sizes (elements) of the trainable tensors: the trainable layers' linears and norms, the
    frozen layers' adapters A and B and, unless frozen (train_embeddings=False after the first
    stage) or left out, embeddings, head and final norm."""
    d, shapes = cfg.n_embd, layer_shapes(cfg)
    layer = [n * k for n, k in shapes] + [d, d]
    adapter = [cfg.lora_rank * m for shape in shapes for m in shape] if cfg.lora_rank else []
    outside = [cfg.vocab_size * d] * (1 if cfg.tie_embeddings else 2) + [d]
    keep_outside = not layers_only and (train_embeddings or n_frozen == 0)
    return layer * n_trainable + adapter * n_frozen + (outside if keep_outside else [])


def state_bytes(cfg, n_trainable=None, n_frozen=None, accounting="int8", train_embeddings=True,
                layers_only=False, per_trainable=TRAINABLE_BYTES):
    """Model-state bytes of a model with n_frozen frozen (+ adapters) and n_trainable trainable
    layers; by default the split that `cfg.frozen_layers` describes. `per_trainable`: bytes per
    trainable parameter (stepgpt/memory.py passes other optimizers' counts)."""
    if n_frozen is None:
        n_frozen = len(cfg.frozen_layers)
        n_trainable = cfg.n_layer - n_frozen
    weights, rows, norms, _ = layer_counts(cfg)
    if accounting == "int8":   # our fp32 training; the frozen store as the config keeps it
        frozen_layer = (2 * weights if cfg.frozen_dtype == "bf16" else weights + 4 * rows) + 4 * norms
    elif accounting == "bf16":
        frozen_layer = 2 * (weights + norms)
    else:
        raise ValueError(f"accounting {accounting!r}: use int8 or bf16")
    total = per_trainable * sum(trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings, layers_only))
    total += n_frozen * frozen_layer
    if not layers_only and not (train_embeddings or n_frozen == 0):   # frozen embeddings stay float
        total += outside_params(cfg) * (4 if accounting == "int8" else 2)
    return int(total)


def stage_memory(cfg, stage_layers, state=state_bytes, **kw):
    """Model-state bytes of each stage: stage i trains n_i new layers next to N_{i-1} frozen ones."""
    done, out = 0, []
    for n in stage_layers:
        out.append(state(cfg, n_trainable=n, n_frozen=done, **kw))
        done += n
    return out


def plan_stages(cfg, target_layers, n_stages, state=state_bytes, **kw):
    """The layer counts n_1..n_K (sum L, all >= 1) that minimise the peak over stages (Eq. 3).
    Enumeration: C(L-1, K-1) splits, trivial for the K <= 4 and L <= 64 of practice. Ties go to the
    plan with the smaller sum of stage memories, then to the lexicographically largest."""
    if not 1 <= n_stages <= target_layers:
        raise UserError(f"n_stages={n_stages} must be between 1 and target_layers={target_layers}")
    best = None
    for cuts in itertools.combinations(range(1, target_layers), n_stages - 1):
        bounds = (0,) + cuts + (target_layers,)
        layers = [b - a for a, b in zip(bounds, bounds[1:])]
        mem = stage_memory(cfg, layers, state, **kw)
        key = (max(mem), sum(mem), [-n for n in layers])
        if best is None or key < best[0]:
            best = (key, layers)
    return best[1]


# ----------------------------------------------------------------------------------------------
# growth operators and the stage transition

def insertion_gaps(n_old, n_new, where, seed=0):
    """For each new layer, the old layer it goes right above (sorted).

    The paper's ablation compares upper, intermediate, lower and random placement without defining
    the regions; ours split the old stack's gaps (one above each old layer, the topmost above the
    top layer) into thirds, so the three regions are apart at any depth of 3 or more. The new layers
    spread evenly over their region's gaps, several per gap where there are more new layers than
    gaps, the surplus towards the top. 'interleave' spreads them over every gap (LLaMA-Pro's block
    expansion), 'random' puts each into a gap drawn uniformly (seeded)."""
    if where == "random":
        gen = torch.Generator().manual_seed(seed)
        return sorted(torch.randint(n_old, (n_new,), generator=gen).tolist())
    size = n_old if where == "interleave" else max(1, math.ceil(n_old / 3))
    first = {"upper": n_old - size, "intermediate": (n_old - size) // 2}.get(where, 0)
    return [first + min(size - 1, ((j + 1) * size - 1) // n_new) for j in range(n_new)]


def _new_block(cfg, sources, weights, init):
    """A trainable block whose tensors are the weighted sum of the source blocks' (dense) tensors, row
    for row: sources holding some rows of each tensor (under FSDP, a rank's own) give those rows."""
    with torch.device("meta"):
        block = Block(cfg)   # the module tree only: every tensor is assigned below
    for name in LINEARS + ("attn_norm", "mlp_norm"):
        w = sum(c * dense_weight(s.get_submodule(name)) for s, c in zip(sources, weights))
        if init == "zero" and name in RESIDUAL_OUT:
            w.zero_()   # the block adds nothing to the residual stream
        block.get_submodule(name).weight = nn.Parameter(w)
    return block


def grow(model, n_new, init="mean", where="upper", seed=0):
    """Insert n_new trainable layers into model in place; returns their indices in the new stack.
    mean (the paper's Interpolation-Mean): one new layer between old layers i and i+1 is their mean;
    k new layers in that gap interpolate, the j-th = (1 - j/(k+1)) layer i + j/(k+1) layer i+1;
    above the top layer, copies of it. copy: copies of the layer below; zero: copy with
    attention-out and MLP-down zeroed, so the grown model computes exactly the small model's
    function; stack: layers 0..n_new-1 repeated on top (G_stack; n_new = L doubles the stack),
    `where` is ignored."""
    old = list(model.layers)
    L = len(old)
    cfg = replace(model.config, n_layer=L + n_new)
    order = []   # (old index, None) for kept layers, (None, block) for new ones
    if init == "stack":
        order = [(i, None) for i in range(L)]
        order += [(None, _new_block(cfg, [old[j % L]], [1.0], "copy")) for j in range(n_new)]
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
    -> the indices of the new layers."""
    g = torch.Generator().manual_seed(seed)
    model.merge_adapters(rounding, g)
    new_idx = grow(model, n_new, init, where, seed) if n_new else []   # 0: freeze only (ReLoRA)
    cfg = model.config
    for i, block in enumerate(model.layers):
        if i not in new_idx and not block.frozen:
            block.freeze(cfg.lora_rank, cfg.lora_alpha, g, cfg.frozen_dtype)
    cfg.frozen_layers = tuple(i for i in range(cfg.n_layer) if i not in new_idx)
    if not train_embeddings:
        model.freeze_embeddings()
    return new_idx


def carried_parameters(model):
    """The optimizer at a new stage: the trainable parameters outside the layer stack (embeddings,
    final norm, head) keep their optimizer state; everything in the stack is new, newly frozen
    behind adapters or a restarted adapter, so it starts fresh."""
    return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("layers.")]


# ----------------------------------------------------------------------------------------------
# CLI

def main(argv):
    p = argparse.ArgumentParser(prog="grow.py", description="grow a checkpoint in depth")
    p.add_argument("ckpt", help="a checkpoint file, or a run folder for its newest")
    p.add_argument("--add", type=int, required=True, help="number of layers to insert")
    p.add_argument("--init", default="mean", choices=INITS)
    p.add_argument("--where", default="upper", choices=PLACEMENTS)
    p.add_argument("--freeze", action="store_true", help="STEP transition: freeze old layers in int8 + LoRA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=new_file, help="the grown checkpoint (a new file)")
    args = p.parse_args(argv)
    if args.add < 1:
        raise UserError(f"--add {args.add}: add at least one layer")
    ckpt = load_checkpoint(args.ckpt)
    model = GPT.from_checkpoint(ckpt, args.ckpt)
    before = model.config.n_layer
    if args.freeze:
        new_idx = next_stage(model, args.add, args.init, args.where, seed=args.seed)
    else:
        new_idx = grow(model, args.add, args.init, args.where, seed=args.seed)
    save_checkpoint(args.out, {"model": model.state_dict(), "model_args": asdict(model.config),
                               "grown_from": args.ckpt, "meta": ckpt.get("meta"),
                               "config": ckpt.get("config", {})})
    tr, fr = model.num_params()
    print(f"grew {args.ckpt} from {before} to {model.config.n_layer} layers ({args.init}, {args.where}); "
          f"new layers {new_idx}; frozen {list(model.config.frozen_layers)}; trainable {tr:,}, frozen "
          f"{fr:,}; wrote {args.out} (train from it with --init_from={args.out})")


if __name__ == "__main__":
    run_cli(main)
