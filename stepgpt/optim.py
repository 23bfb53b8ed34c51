"""Optimizers beyond plain AdamW and what STEP's stage changes ask of them: bitsandbytes' 8-bit
AdamW, GaLore, ZeRO-1 (with the hand-over of state at a stage change), and ReLoRA's reset of the
adapters' state at a restart. train.configure_optimizer builds the parameter groups."""
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from stepgpt import sharding
from stepgpt.errors import UserError


def build(model, groups, cfg, device, previous=None, carried=(), **kw):
    """The optimizer cfg.optimizer names over `groups` (AdamW's keywords in kw), holding the state of
    the `carried` parameters that the `previous` optimizer had (a new stage)."""
    opt = _build(model, groups, cfg, device, **kw)
    if isinstance(opt, ZeroRedundancyOptimizer) and previous is not None:
        hand_over_zero1_state(previous, opt, carried)
    elif previous is not None:
        opt.state.update({p: previous.state[p] for p in carried if p in previous.state})
    return opt


def _build(model, groups, cfg, device, **kw):
    if cfg.optimizer == "adamw8bit":   # blockwise 8-bit moments (tensors under 4,096 elements: fp32)
        try:
            import bitsandbytes
        except ImportError:
            raise UserError("optimizer=adamw8bit needs the bitsandbytes package: "
                            "pip install bitsandbytes==0.50.2") from None
        return bitsandbytes.optim.AdamW8bit(groups, **kw)
    if cfg.optimizer == "galore":   # GaLore's AdamW projects the layers' matrix gradients to galore_rank
        try:
            from galore_torch import GaLoreAdamW
        except ImportError:
            raise UserError("optimizer=galore needs the galore-torch package: "
                            "pip install galore-torch==1.0") from None
        projected = {p for n, p in model.named_parameters()
                     if p.requires_grad and n.startswith("layers.") and p.dim() == 2 and "lora_" not in n}
        galore = {"rank": cfg.galore_rank, "update_proj_gap": cfg.galore_update_proj_gap,
                  "scale": cfg.galore_scale, "proj_type": "std"}
        split = []
        for g in groups:
            mine = [p for p in g["params"] if p in projected]
            rest = [p for p in g["params"] if p not in projected]
            split += [{**g, "params": rest}] * bool(rest) + [{**g, "params": mine, **galore}] * bool(mine)
        return GaLoreAdamW(split, no_deprecation_warning=True, **kw)
    fused = device.type == "cuda"
    if cfg.zero1 and dist.is_initialized():
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, fused=fused, **kw)
    return torch.optim.AdamW(groups, fused=fused, **kw)


def local_state(opt):
    """The per-parameter state this rank holds: all of it, or under ZeRO-1 its own shard's."""
    return opt.optim.state if isinstance(opt, ZeroRedundancyOptimizer) else opt.state


def hand_over_zero1_state(old, new, params):
    """At a stage change under ZeRO-1, hand the AdamW state of `params` from the old optimizer to the
    new one: it lives on the rank that owned the parameter before and goes to the rank that owns it
    now (the shards are rebuilt over the new parameter set)."""
    rank, fused = dist.get_rank(), new.optim.defaults.get("fused")
    for p in params:
        src = old._param_to_rank[p]
        mine = old.optim.state.get(p) if rank == src else None
        step = torch.tensor(float(mine["step"]) if mine else -1.0, dtype=torch.float64, device=p.device)
        dist.broadcast(step, src)
        if step.item() < 0:   # no state yet
            continue
        moments = {k: mine[k] if mine else torch.empty_like(p) for k in ("exp_avg", "exp_avg_sq")}
        for t in moments.values():
            dist.broadcast(t, src)
        if new._param_to_rank[p] == rank:
            new.optim.state[p] = {"step": torch.tensor(step.item(), dtype=torch.float32,
                                                       device=p.device if fused else "cpu"), **moments}


def state_dict(opt):
    """The full state dict (collective under ZeRO-1: every rank must call it). Plain AdamW and
    ZeRO-1 use the same format, so a checkpoint resumes with zero1 on or off."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if dist.get_rank() == 0 else None
    return opt.state_dict()


def relora_restart(model, opt, cfg, it):
    """ReLoRA inside a stage: merge the adapters into the frozen weights (the merge's sums in
    model.last_merge), restart them and their optimizer state."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it)
    if sharding.sharded(model):   # on each rank's own rows, written back into its shards
        sharding.merge_in_place(model, lambda rows: rows.merge_adapters(cfg.merge_rounding, g))
    else:
        model.merge_adapters(cfg.merge_rounding, g)
    reset_adapter_state(model, opt, cfg.relora_prune)


def reset_adapter_state(model, opt, prune=1.0):
    """At a ReLoRA restart: forget the adapters' AdamW state (prune=1), or zero the share `prune` of
    each moment tensor with the smallest magnitudes (ReLoRA's partial reset; its paper uses ~0.99)."""
    state = local_state(opt)
    for name, p in model.named_parameters():
        if "lora_" not in name or p not in state:
            continue
        if prune >= 1:
            del state[p]
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            m = state[p][key]
            if m.numel() and prune > 0:
                m.mul_(m.abs() > torch.quantile(m.abs().flatten().float(), prune).to(m.dtype))
