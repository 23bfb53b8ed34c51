"""Sharded training with PyTorch's FSDP2 (`fsdp=True` under torchrun): every tensor of the model, its
gradients and its AdamW state are split by rows over the ranks, the frozen int8 store and its row
scales included (frozen parameters: no gradient, no optimizer state). Each block is one
`fully_shard` unit and the root (embeddings, final norm, head) another: a block's rows are
all-gathered just before its forward (and again for its backward) and freed after it, so a rank
holds its own 1/world share of everything plus about one whole block at a time. Gradients are
reduce-scattered after every micro-step's backward, so they stay sharded too.

A stage boundary runs on shards: every step of STEP's transition is row-local on dim-0 shards
(merging W + s B A needs a row's W and B and all of A, small; the growth operators combine the
same rows of two layers; int8 quantisation has one scale per row), so each rank runs the very code
one process runs (grow.next_stage) on a plain model of its own rows, then the grown model is built
on the meta device and sharded around the rows it made. A ReLoRA merge does the same in place.

A model built from scratch is built on the meta device (no memory) and materialised shard by
shard with the values GPT(cfg) draws on one process from the same seed: the constructor's random
draws are recorded on the meta device and replayed one tensor at a time on the CPU, each rank
keeping its own rows.
"""
import functools
import hashlib
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import frozen_linear
from model import GPT, LINEARS, FrozenLoRALinear, GPTConfig, rope_cache
from stepgpt import kernels, safeload
from stepgpt.errors import UserError


def sharded(model):
    return isinstance(model, FSDPModule)


def check(run):
    """FSDP needs torchrun's ranks; refused in one line before any training. (The world sizes whose
    ranks all run as many eval batches: runtime.check_world.)"""
    if not dist.is_initialized():
        raise UserError("fsdp=True shards the model over torchrun's ranks: start it with torchrun "
                        "--nproc_per_node=N (N >= 2), or drop --fsdp=True")


@functools.cache
def _mesh(device_type, world):
    return init_device_mesh(device_type, (world,))


def _policy(run, module):
    """Under bf16 autocast, a block with no frozen store gathers its weights in bf16 (half the bytes)
    and reduces gradients in fp32; frozen blocks and the root gather as stored: FSDP2 never casts the
    int8 store, but it would cast its fp32 row scales, which the kernels read in fp32, and the
    embedding's output would take the residual stream to bf16. cast_forward_inputs=False keeps the
    residual stream fp32, as under DDP."""
    frozen = any(isinstance(m, FrozenLoRALinear) for m in module.modules())
    if run.dtype != "bfloat16" or frozen:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


def shard(run, model):
    """fully_shard each block, then the root; the model stays where it is (meta or materialised)."""
    mesh = _mesh(run.device.type, run.world)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=_policy(run, block))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    return model


def skeleton(cfg, frozen=FrozenLoRALinear):
    """GPT(cfg) on the meta device, frozen layers included (shapes, dtypes and which tensors train;
    no memory, no values). Block.freeze quantises real weights, which meta tensors do not have, so
    the frozen linears (of class `frozen`) are built empty here: tests/test_fsdp.py checks the tree
    against GPT(cfg)."""
    with torch.device("meta"):
        model = GPT(replace(cfg, frozen_layers=()))
        for i in cfg.frozen_layers:
            block = model.layers[i]
            for name in LINEARS:
                parent, child = name.split(".")
                lin = block.linear(name)
                setattr(getattr(block, parent), child, frozen(
                    lin.in_features, lin.out_features, cfg.lora_rank, cfg.lora_alpha, dtype=cfg.frozen_dtype))
            block.attn_norm.weight.requires_grad_(False)
            block.mlp_norm.weight.requires_grad_(False)
    model.config = cfg
    return model


def _materialise(run, model):
    """Storage for the local shards (uninitialised) and the RoPE tables, which no state dict holds."""
    model.to_empty(device=run.device)
    _rope(run, model)


def _rope(run, model):
    cfg = model.config
    model.rope_cos, model.rope_sin = (t.to(run.device) for t in rope_cache(cfg.n_embd // cfg.n_head,
                                                                           cfg.block_size, cfg.rope_theta))


class _Draws(TorchDispatchMode):
    """Records the random in-place ops (normal_, uniform_, ...) run on meta tensors, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and args and args[0].is_meta:
            self.ops.append((func, args[0], args[1:], kwargs or {}))
        return func(*args, **(kwargs or {}))


def _rows(param):
    """This rank's rows of a sharded parameter: a slice of dim 0, which FSDP2 splits as torch.chunk
    does (ceil(n / world) rows per rank, the last ranks' fewer or none)."""
    n, size = param.shape[0], -(-param.shape[0] // param.device_mesh.size())
    first = min(param.device_mesh.get_local_rank() * size, n)
    return slice(first, min(first + size, n))


def _local_rows(full, param):
    """This rank's rows of the whole tensor `full` as FSDP2 shards `param`. -> (its shard, the rows)."""
    local, mine = param.to_local(), full[_rows(param)]
    assert mine.shape == local.shape, (mine.shape, local.shape)
    return local, mine


@torch.no_grad()
def new_model(run, cfg):
    """A sharded GPT(cfg) with the values GPT(cfg) gets on one process from the current RNG state,
    without the whole model ever existing: built on the meta device, sharded, then the constructor's
    draws replayed in order on the CPU, one whole tensor at a time (so the generator advances
    exactly as on one process), each rank keeping its rows of each parameter's last draw. What the
    constructor does not draw is an RMSNorm weight (ones) or the RoPE tables."""
    check(run)
    with torch.device("meta"), _Draws() as draws:
        model = GPT(cfg)
    names = {id(p): name for name, p in model.named_parameters()}   # before fully_shard replaces them
    last = {id(t): i for i, (_, t, _, _) in enumerate(draws.ops)}
    shard(run, model)
    _materialise(run, model)
    drawn = set()
    for i, (func, t, args, kwargs) in enumerate(draws.ops):
        full = func(torch.empty(t.shape, dtype=t.dtype), *args, **kwargs)
        if last[id(t)] == i:
            if id(t) not in names:
                raise RuntimeError(f"GPT's constructor drew into a tensor that is not a parameter ({func})")
            local, mine = _local_rows(full, model.get_parameter(names[id(t)]))
            local.copy_(mine)
            drawn.add(names[id(t)])
    for name, p in model.named_parameters():
        if name not in drawn:
            if not name.endswith("norm.weight"):
                raise RuntimeError(f"no initial value for {name}: GPT's constructor changed; see {__name__}")
            p.to_local().fill_(1.0)
    return model


def from_state(run, ckpt, state=None):
    """A sharded GPT of a checkpoint's config (ckpt["model_args"], or a GPTConfig) holding `state` (by
    default ckpt["model"]), a full state dict that rank 0 holds (the other ranks' is not read): built
    on the meta device, then each tensor broadcast from rank 0 in turn, each rank keeping its rows.
    A checkpoint folder's (ckpt["dcp"]): each rank reads its rows from the folder's files itself."""
    check(run)
    cfg = ckpt if isinstance(ckpt, GPTConfig) else GPTConfig.from_dict(ckpt["model_args"])
    model = shard(run, skeleton(cfg))
    _materialise(run, model)
    if isinstance(ckpt, dict) and "dcp" in ckpt:
        safeload.load_dcp({"model": model.state_dict()}, ckpt["dcp"])
        return model
    state = ckpt["model"] if state is None else state
    set_model_state_dict(model, state if run.master else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def shard_plain(run, model):
    """A plain model sharded (stage 1 from a Hugging Face folder, which every rank reads whole); a
    model that new_model or from_state built is sharded already."""
    if sharded(model):
        return model
    return from_state(run, model.config, model.state_dict())


def full_state(model):
    """The model's state dict gathered whole to rank 0's CPU, one tensor at a time (collective;
    {} on the other ranks)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class _Rows(FrozenLoRALinear):
    """A frozen linear of a rank's local model (_local_model): weight_q, weight_scale and B hold the
    rows `rows` of `total`, A is whole. FrozenLoRALinear's merge and adapter restart run on it as
    they are, being row-local: W's rows + s B's rows A, one int8 scale per row, A drawn whole from
    the stage's generator. Stochastic rounding alone needs the whole shape: its noise is drawn for
    the whole weight (so the generator gives every rank the bits one process draws), so the rows are
    rounded inside a whole-shaped weight whose other rows are zeros, and kept."""
    rows, total = slice(None), 0

    def store(self, w, stochastic=False, generator=None):
        if not stochastic:
            return super().store(w)
        whole = w.new_zeros(self.total, w.shape[1])
        whole[self.rows] = w
        super().store(whole, stochastic, generator)
        self.weight_q.data = self.weight_q[self.rows].clone()
        if self.weight_scale is not None:
            self.weight_scale.data = self.weight_scale[self.rows].clone()


@torch.no_grad()
def _local_model(model):
    """A plain GPT of this rank's rows of a sharded model, around its shards' own storage (no copy),
    for grow.next_stage or a merge to run on as they are: every step of a boundary is row-local on
    dim-0 shards, given each frozen linear's A whole (gathered here: r rows, small)."""
    local = skeleton(model.config, frozen=_Rows)
    for name, p in model.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        module = local.get_submodule(owner)
        t = p.full_tensor() if leaf == "lora_a" else p.to_local()
        setattr(module, leaf, nn.Parameter(t, requires_grad=p.requires_grad))
        if leaf == "weight_q":
            module.rows, module.total = _rows(p), p.shape[0]
    if model.config.tie_embeddings:
        local.lm_head.weight = local.wte.weight
    return local


def _mine(local, name, p):
    """This rank's rows of the parameter `name` of a sharded model, `p`, from `local` (_local_model,
    after a boundary or merge), where each A is whole."""
    t = local.get_parameter(name).detach()
    t = t[_rows(p)] if name.endswith("lora_a") else t
    if t.shape != p.to_local().shape:   # copy_ would broadcast some mismatches silently
        raise RuntimeError(f"{name}: this rank's rows are {tuple(t.shape)}, its shard "
                           f"{tuple(p.to_local().shape)}")
    return t


def _summed(sums, device):
    """A merge's sums (model.last_merge) of this rank's rows, added up over the ranks."""
    if sums is None:
        return None
    total = sums.to(device)
    dist.all_reduce(total)
    return total.cpu()


def next_stage(run, model, opt, transition):
    """A stage boundary under FSDP, on shards: transition(model) (grow.next_stage with the stage's
    arguments, the same code one process runs) on this rank's rows (_local_model); the old model
    freed; the grown one built on the meta device, sharded, its shards the rows the transition made.
    A rank holds its share of the old model and of what the boundary changes, each frozen linear's A
    whole and, one weight at a time, the whole weight while a stochastic merge rounds it (its noise
    is drawn whole): never the whole model. The optimizer state of the parameters that carry over
    (the embeddings, final norm and head) moves to their successors of the same name, where
    train.configure_optimizer finds it. -> the new sharded model."""
    local = _local_model(model)
    transition(local)
    carried = {name: (p.shape, opt.state.pop(p)) for name, p in model.named_parameters() if p in opt.state}
    # free the old shards now, not whenever the garbage collector gets to FSDP's reference cycles
    # (measured: otherwise they outlive the next steps); what carries over lives on in `local`
    model.to_empty(device="meta")
    new = shard(run, skeleton(local.config))
    # the new shards take the rows' own storage (FSDP2 adopts an assigned DTensor's local tensor; it
    # copies only a rank's rows that need padding to an even share): nothing is copied twice
    state, made = {}, {}
    for name, p in new.state_dict(keep_vars=True).items():   # tied embeddings: two names, one parameter
        if id(p) not in made:
            made[id(p)] = nn.Parameter(_dtensor_like(_mine(local, name, p), p), requires_grad=p.requires_grad)
        state[name] = made[id(p)]
    new.load_state_dict(state, assign=True)
    _rope(run, new)
    new.last_merge = _summed(local.last_merge, run.device)
    for name, p in new.named_parameters():
        if name in carried and carried[name][0] == p.shape:
            opt.state[p] = carried[name][1]
    return new


def merge_in_place(model, merge):
    """A ReLoRA restart under FSDP: merge(model) on this rank's rows (_local_model), written back into
    the same sharded parameters (the module tree is unchanged, the optimizer keeps its references)."""
    local = _local_model(model)
    merge(local)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(_mine(local, name, p))
    model.last_merge = _summed(local.last_merge, model.wte.weight.device)


def full_optimizer_state(opt):
    """opt.state_dict() with each sharded state tensor gathered whole to rank 0's CPU: torch.optim's
    own format, keyed by parameter index, as one process and DDP write it (DCP's full optimizer
    state dict is keyed by parameter names instead). Collective; None on the other ranks."""
    master = dist.get_rank() == 0

    def whole(v):
        if not isinstance(v, DTensor):
            return v
        full = v.full_tensor()
        return full.cpu() if master else None

    sd = opt.state_dict()   # its per-parameter dicts are the optimizer's own: build new ones
    sd["state"] = {i: {k: whole(v) for k, v in s.items()} for i, s in sd["state"].items()}
    return sd if master else None


def load_optimizer(opt, ckpt):
    """A checkpoint's optimizer state into the optimizer of a sharded model. A file's (ckpt["optimizer"],
    a full state dict that rank 0 read; the other ranks' is None): its layout broadcast, then each
    state tensor shaped like its parameter broadcast whole in turn, each rank keeping its rows. A
    folder's (ckpt["dcp"]; its layout on every rank): each rank reads its rows from its files."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if "dcp" in ckpt:
        state = {i: {k: _empty_like(v, params[i]) if is_spec(v) else v for k, v in s.items()}
                 for i, s in ckpt["optimizer"]["state"].items()}
        tensors = {i: {k: v for k, v in s.items() if torch.is_tensor(v)} for i, s in state.items()}
        safeload.load_dcp({"optimizer": tensors}, ckpt["dcp"])
        opt.load_state_dict({**ckpt["optimizer"], "state": state})
        return
    sd = ckpt["optimizer"]
    whole = lambda v, p: torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == p.shape  # noqa: E731
    layout = [None]
    if dist.get_rank() == 0:   # the state with each whole tensor as ("whole", shape, dtype)
        layout = [{**sd, "state": {i: {k: ("whole", v.shape, v.dtype) if whole(v, params[i]) else v
                                       for k, v in s.items()} for i, s in sd["state"].items()}}]
    dist.broadcast_object_list(layout, src=0)
    state = {}
    for i, s in layout[0]["state"].items():
        p, state[i] = params[i], {}
        for k, v in s.items():
            if not (isinstance(v, tuple) and v[0] == "whole"):
                state[i][k] = v
                continue
            full = (sd["state"][i][k].to(p.device) if sd is not None
                    else torch.empty(v[1], dtype=v[2], device=p.device))
            dist.broadcast(full, src=0)
            state[i][k] = _dtensor_like(_local_rows(full, p)[1].clone(), p)
    opt.load_state_dict({**layout[0], "state": state})


def spec(t):
    """What a checkpoint folder's header holds in a tensor's place (DCP's files hold the tensor)."""
    return ("tensor", tuple(t.shape), t.dtype)


def is_spec(v):
    return isinstance(v, tuple) and len(v) == 3 and v[0] == "tensor"


def _dtensor_like(local, p):
    """A DTensor sharded as the parameter p, around this rank's rows `local`."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _empty_like(v, p):
    """An empty tensor that a checkpoint folder's state tensor (spec v) is read into: sharded as the
    parameter p where it is p's shape (AdamW's moments), else whole (its step)."""
    _, shape, dtype = v
    if isinstance(p, DTensor) and tuple(p.shape) == shape:
        return _dtensor_like(torch.empty(p.to_local().shape, dtype=dtype, device=p.device), p)
    return torch.empty(shape, dtype=dtype)


def structure_digest(model):
    """What all ranks of a sharded model must agree on: no tensor has replicas under FSDP (each row
    lives on one rank), but a rank that made another transition holds another model."""
    tree = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    return hashlib.blake2b(repr((tree, asdict(model.config))).encode(), digest_size=16).hexdigest()


def wrap(run, model):
    """-> (what the train step calls, what eval calls) under FSDP: the sharded model, each block compiled
    alone (FSDP2's hooks gather and free its rows around the compiled forward). On CUDA each block's
    kernel paths are measured on its gathered weights first, one block at a time."""
    tokens, dtype = run.cfg.batch_size * run.cfg.block_size, getattr(torch, run.dtype)
    for block in model.layers:
        if run.device.type == "cuda":
            block.unshard()
            kernels.measure_layers(block, tokens, dtype, (frozen_linear.forward, frozen_linear.backward))
            block.reshard()
        if run.compiled:
            block.compile()
    return model, model
