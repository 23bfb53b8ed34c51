"""The optimizers and what STEP's stage changes ask of them: AdamW, Muon (torch.optim.Muon on the
hidden matrices, AdamW on the rest), bitsandbytes' 8-bit AdamW, GaLore, ZeRO-1 (with the hand-over
of state at a stage change), and ReLoRA's reset of the adapters' state at a restart.
train.configure_optimizer builds the parameter groups."""
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


def hidden_matrices(model, adapters=False):
    """The 2-D matrices of the layer stack that train: the trainable layers' seven linear weights (at
    full rank), and with adapters=True the frozen layers' LoRA A and B too. GaLore projects the
    first kind; Muon orthogonalises the updates of either."""
    return {p for n, p in model.named_parameters() if p.requires_grad and n.startswith("layers.")
            and p.dim() == 2 and (adapters or "lora_" not in n)}


def split_groups(groups, chosen, options):
    """Each group split in two: its parameters outside `chosen`, and those in it with `options` added."""
    out = []
    for g in groups:
        mine = [p for p in g["params"] if p in chosen]
        rest = [p for p in g["params"] if p not in chosen]
        out += [{**g, "params": rest}] * bool(rest) + [{**g, "params": mine, **options(g)}] * bool(mine)
    return out


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
        galore = {"rank": cfg.galore_rank, "update_proj_gap": cfg.galore_update_proj_gap,
                  "scale": cfg.galore_scale, "proj_type": "std"}
        return GaLoreAdamW(split_groups(groups, hidden_matrices(model), lambda g: galore),
                           no_deprecation_warning=True, **kw)
    fused, kind = device.type == "cuda", torch.optim.AdamW
    if cfg.optimizer == "muon":
        scale = cfg.muon_lr / cfg.learning_rate

        def muon(g):   # steps at lr * lr_scale; the weights shrink by lr * weight_decay a step, as AdamW's
            return {"muon": True, "lr_scale": scale, "weight_decay": g["weight_decay"] / scale,
                    "momentum": cfg.muon_momentum, "adjust_lr_fn": cfg.muon_adjust_lr}
        groups, kind = split_groups(groups, hidden_matrices(model, cfg.muon_adapters), muon), MuonAdamW
    if cfg.zero1 and dist.is_initialized():
        return ZeroRedundancyOptimizer(groups, optimizer_class=kind, fused=fused, **kw)
    return kind(groups, fused=fused, **kw)


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the groups marked muon=True, torch.optim.AdamW over the others, as one
    optimizer to train.py, the checkpoints and ZeRO-1: one list of groups, one state, torch.optim's
    state-dict format. train.py sets every group's lr to the schedule's; a Muon group steps at
    lr * lr_scale (muon_lr / learning_rate), so the schedule's shape is the same for both."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), fused=False):
        super().__init__(params, dict(lr=lr, betas=betas, fused=fused, weight_decay=0.0, muon=False,
                                      lr_scale=1.0))
        self.parts = []   # (muon?, the torch optimizer that steps those groups)
        for muon, kind, kw in ((True, torch.optim.Muon, {}), (False, torch.optim.AdamW, {"fused": fused})):
            mine = [{"params": g["params"]} for g in self.param_groups if g["muon"] == muon]
            if mine:
                self.parts.append((muon, kind(mine, **kw)))

    @torch.no_grad()
    def step(self):
        for muon, opt in self.parts:
            opt.state = self.state   # the one state (a resume's load_state_dict replaces self.state)
            for ours, theirs in zip([g for g in self.param_groups if g["muon"] == muon], opt.param_groups):
                theirs.update({k: ours[k] for k in theirs if k in ours}, lr=ours["lr"] * ours["lr_scale"])
            opt.step()


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
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):   # AdamW's moments, or Muon's
            m = state[p].get(key)
            if m is not None and m.numel() and prune > 0:
                m.mul_(m.abs() > torch.quantile(m.abs().flatten().float(), prune).to(m.dtype))
