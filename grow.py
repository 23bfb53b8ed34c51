"""STEP's two tools: the memory model with its stage planner, and the growth operators.

  python grow.py plan config/step_350m.py [--stages K] [--rank r] [--budget 6e9]
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
from dataclasses import asdict

import torch
import torch.nn as nn

from model import LINEARS, RESIDUAL_OUT, Block, UserError, dense_weight, run_cli

INITS = ("mean", "copy", "zero", "stack")
PLACEMENTS = ("upper", "lower", "interleave", "random")
TRAINABLE_BYTES = 16


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


def state_bytes(cfg, n_trainable=None, n_frozen=None, accounting="int8", train_embeddings=True, layers_only=False):
    """Model-state bytes of a model with n_frozen frozen (+ adapters) and n_trainable trainable
    layers; by default the split that `cfg.frozen_layers` describes."""
    if n_frozen is None:
        n_frozen = len(cfg.frozen_layers)
        n_trainable = cfg.n_layer - n_frozen
    weights, rows, norms, adapter = layer_counts(cfg)
    total = n_trainable * TRAINABLE_BYTES * (weights + norms)
    if accounting == "int8":
        frozen_layer = weights + 4 * rows + 4 * norms
    elif accounting == "bf16":
        frozen_layer = 2 * (weights + norms)
    else:
        raise ValueError(f"accounting {accounting!r}: use int8 or bf16")
    total += n_frozen * (frozen_layer + TRAINABLE_BYTES * adapter)
    if not layers_only:
        outside = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2) + cfg.n_embd
        frozen_cost = 4 if accounting == "int8" else 2   # a frozen embedding stays a float tensor
        total += outside * (TRAINABLE_BYTES if train_embeddings or n_frozen == 0 else frozen_cost)
    return total


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


def smallest_plan(cfg, target_layers, budget, max_stages=8, **kw):
    """The fewest stages whose planned peak fits `budget` bytes -> (K, layers, peak)."""
    for k in range(1, min(max_stages, target_layers) + 1):
        layers = plan_stages(cfg, target_layers, k, **kw)
        peak = max(stage_memory(cfg, layers, **kw))
        if peak <= budget:
            return k, layers, peak
    raise UserError(f"no plan of up to {min(max_stages, target_layers)} stages fits {budget / 2**30:.2f} GiB "
                    f"(the best needs {peak / 2**30:.2f} GiB); raise the budget or lower lora_rank")


def measured_state_bytes(model, opt):
    """Model-state bytes measured from the live tensors: parameters, their gradients and the AdamW
    moments (the per-tensor `step` scalar is bookkeeping, not counted), and the persistent buffers
    (int8 weights and their scales)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.numel() == p.numel():
                total += v.numel() * v.element_size()
    persistent = model.state_dict().keys()
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n in persistent)
    return total


# ----------------------------------------------------------------------------------------------
# growth operators

def insertion_gaps(n_old, n_new, where, seed=0):
    """For each new layer, the old layer it goes right above (sorted). 'upper' fills the gaps above
    the top layers first, 'lower' those above the bottom ones, 'interleave' spreads them evenly,
    'random' draws them (seeded). More new layers than gaps wrap around."""
    if where == "upper":
        gaps = [n_old - 1 - (j % n_old) for j in range(n_new)]
    elif where == "lower":
        gaps = [j % n_old for j in range(n_new)]
    elif where == "interleave":
        gaps = [min(n_old - 1, (j + 1) * n_old // n_new - 1) if n_new <= n_old else j % n_old for j in range(n_new)]
    elif where == "random":
        perm = torch.randperm(n_old, generator=torch.Generator().manual_seed(seed)).tolist()
        gaps = [perm[j % n_old] for j in range(n_new)]
    else:
        raise UserError(f"where={where!r}: use one of {PLACEMENTS}")
    return sorted(gaps)


def _new_block(cfg, sources, init):
    """A trainable block whose tensors are the mean of the source blocks' (dense) tensors."""
    block = Block(cfg)
    with torch.no_grad():
        for name in LINEARS:
            w = sum(dense_weight(s.linear(name)) for s in sources) / len(sources)
            block.linear(name).weight.copy_(w)
            if init == "zero" and name in RESIDUAL_OUT:
                block.linear(name).weight.zero_()   # the block adds nothing to the residual stream
        for norm in ("attn_norm", "mlp_norm"):
            getattr(block, norm).weight.copy_(sum(getattr(s, norm).weight for s in sources) / len(sources))
    return block.to(sources[0].attn_norm.weight.device)


def grow(model, n_new, init="mean", where="upper", seed=0):
    """Insert n_new trainable layers into model in place; returns their indices in the new stack.
    mean: between layers i and i+1 the mean of the two (above the top layer, a copy of it);
    copy: a copy of the layer below; zero: copy with attention-out and MLP-down zeroed, so the
    grown model computes exactly the small model's function; stack: layers 0..n_new-1 repeated on
    top (G_stack; n_new = L doubles the stack), `where` is ignored."""
    if init not in INITS:
        raise UserError(f"init={init!r}: use one of {INITS}")
    if n_new < 1:
        raise UserError(f"add at least one layer (got {n_new})")
    old = list(model.layers)
    L = len(old)
    cfg = copy.copy(model.config)
    cfg.n_layer = L + n_new
    order, new_idx = [], []   # order: (old index, None) for kept layers, (None, block) for new ones
    if init == "stack":
        order = [(i, None) for i in range(L)] + [(None, _new_block(cfg, [old[j % L]], "copy")) for j in range(n_new)]
    else:
        gaps = insertion_gaps(L, n_new, where, seed)
        for i in range(L):
            order.append((i, None))
            for _ in range(gaps.count(i)):
                sources = [old[i], old[i + 1]] if init == "mean" and i + 1 < L else [old[i]]
                order.append((None, _new_block(cfg, sources, init)))
    frozen = set(model.config.frozen_layers)
    cfg.frozen_layers = tuple(k for k, (i, _) in enumerate(order) if i is not None and i in frozen)
    new_idx = [k for k, (i, _) in enumerate(order) if i is None]
    model.layers = nn.ModuleList(old[i] if i is not None else b for i, b in order)
    model.config = cfg
    return new_idx


def next_stage(model, n_new, init="mean", where="upper", seed=0, train_embeddings=True):
    """STEP's stage transition: merge the adapters of already-frozen layers into their int8 weights
    (and restart them), grow n_new layers, freeze every layer that is not new (and, unless
    train_embeddings, the embeddings, final norm and head)."""
    for i in model.config.frozen_layers:
        model.layers[i].merge_adapters()
    new_idx = grow(model, n_new, init, where, seed)
    cfg = model.config
    for i, block in enumerate(model.layers):
        if i not in new_idx and not block.frozen:
            block.freeze(cfg.lora_rank, cfg.lora_alpha)
    cfg.frozen_layers = tuple(i for i in range(cfg.n_layer) if i not in new_idx)
    if not train_embeddings:
        model.freeze_embeddings()
    return new_idx


# ----------------------------------------------------------------------------------------------
# CLI

def _plan_cli(args):
    import train
    tcfg = train.load_config([args.config] + (["--lora_rank=%d" % args.rank] if args.rank else []))
    target = tcfg.target_layers or sum(tcfg.stage_layers) or tcfg.n_layer
    vocab = args.vocab or 32000
    cfg = train.model_config(tcfg, target, 64 * -(-vocab // 64))
    kw = dict(train_embeddings=tcfg.train_embeddings)
    print(f"{args.config}: {target} layers, n_embd {cfg.n_embd}, ffn {cfg.ffn_hidden}, vocab {cfg.vocab_size}, "
          f"lora rank {cfg.lora_rank}, embeddings {'trainable' if tcfg.train_embeddings else 'frozen'} in later stages")
    if args.budget:
        k, layers, peak = smallest_plan(cfg, target, args.budget, **kw)
        print(f"budget {args.budget / 2**30:.2f} GiB (int8 accounting, all tensors): smallest K = {k}, layers {layers}, peak {peak / 2**30:.2f} GiB")
    stages = [args.stages] if args.stages else sorted({2, 3, tcfg.n_stages if tcfg.target_layers else len(tcfg.stage_layers) or 1})
    for acc in ("bf16", "int8"):
        for scope, layers_only in (("all tensors", False), ("layers only, as the paper", True)):
            vanilla = state_bytes(cfg, n_trainable=target, n_frozen=0, accounting=acc, layers_only=layers_only)
            print(f"\n{acc} accounting, {scope}: vanilla {target} layers = {vanilla / 2**30:.3f} GiB")
            print(f"{'K':>3} {'layers':<16} {'stage bytes (GiB)':<36} {'peak GiB':>9} {'% of vanilla':>13} {'reduction':>10}")
            for k in stages:
                layers = plan_stages(cfg, target, k, accounting=acc, layers_only=layers_only, **kw)
                mem = stage_memory(cfg, layers, accounting=acc, layers_only=layers_only, **kw)
                print(f"{k:>3} {str(layers):<16} {' '.join(f'{m / 2**30:.3f}' for m in mem):<36} "
                      f"{max(mem) / 2**30:9.3f} {100 * max(mem) / vanilla:12.1f}% {100 * (1 - max(mem) / vanilla):9.1f}%")


def _grow_cli(args):
    import train
    ckpt = train.load_checkpoint(args.ckpt)
    model = train.model_from_checkpoint(ckpt, args.ckpt)
    before = model.config.n_layer
    if args.freeze:
        new_idx = next_stage(model, args.add, args.init, args.where, seed=args.seed)
    else:
        new_idx = grow(model, args.add, args.init, args.where, seed=args.seed)
    train.save_checkpoint(args.out, {"model": model.state_dict(), "model_args": asdict(model.config),
                                     "grown_from": args.ckpt, "meta": ckpt.get("meta"),
                                     "config": ckpt.get("config", {})})
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
        p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default 32000, the paper's LLaMA)")
        p.add_argument("--budget", type=float, default=0, help="bytes: report the smallest K that fits")
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
