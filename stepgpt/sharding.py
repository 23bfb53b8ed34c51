"""Sharded training with PyTorch's FSDP2 (`fsdp=True` under torchrun): every tensor of the model, its
gradients and its AdamW state are split by rows over the ranks, the frozen int8 store and its row
scales included (frozen parameters: no gradient, no optimizer state). Each block is one
`fully_shard` unit and the root (embeddings, final norm, head) another: a block's rows are
all-gathered just before its forward (and again for its backward) and freed after it, so a rank
holds its own 1/world share of everything plus about one whole block at a time. Gradients are
reduce-scattered after every micro-step's backward, so they stay sharded too.

Where the whole model must exist, it exists once, on rank 0's CPU, never on a GPU: a checkpoint
is gathered there into the one format that 1 process, DDP and FSDP share; a stage boundary runs
STEP's transition (grow.next_stage) on a copy gathered there, by the same code as one process,
then shards the grown model anew; a ReLoRA merge does the same into the same parameters.
docs/distributed.md says what that costs and where it stops fitting.

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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import frozen_linear
from data.load import eval_batches
from model import GPT, LINEARS, FrozenLoRALinear, GPTConfig, rope_cache
from stepgpt import kernels
from stepgpt.errors import UserError


def sharded(model):
    return isinstance(model, FSDPModule)


def check(run):
    """The settings FSDP cannot run with, each refused in one line before any training."""
    cfg = run.cfg
    if not dist.is_initialized():
        raise UserError("fsdp=True shards the model over torchrun's ranks: start it with torchrun "
                        "--nproc_per_node=N (N >= 2), or drop --fsdp=True")
    evals = {"eval_iters": cfg.eval_iters}
    if cfg.eval_tokens:
        evals["eval_tokens"] = eval_batches(run.data, cfg.eval_tokens, cfg.batch_size, cfg.block_size)
    for key, n in evals.items():
        if n % run.world:
            raise UserError(f"fsdp=True: {key}={getattr(cfg, key)} makes {n} eval batches, not a "
                            f"multiple of the world size {run.world} (each forward gathers every block from "
                            f"all ranks, so all ranks must run as many)")


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


def skeleton(cfg):
    """GPT(cfg) on the meta device, frozen layers included (shapes, dtypes and which tensors train;
    no memory, no values). Block.freeze quantises real weights, which meta tensors do not have, so
    the frozen linears are built empty here: tests/test_fsdp.py checks the tree against GPT(cfg)."""
    with torch.device("meta"):
        model = GPT(replace(cfg, frozen_layers=()))
        for i in cfg.frozen_layers:
            block = model.layers[i]
            for name in LINEARS:
                parent, child = name.split(".")
                lin = block.linear(name)
                setattr(getattr(block, parent), child, FrozenLoRALinear(
                    lin.in_features, lin.out_features, cfg.lora_rank, cfg.lora_alpha, dtype=cfg.frozen_dtype))
            block.attn_norm.weight.requires_grad_(False)
            block.mlp_norm.weight.requires_grad_(False)
    model.config = cfg
    return model


def _materialise(run, model):
    """Storage for the local shards (uninitialised) and the RoPE tables, which no state dict holds."""
    model.to_empty(device=run.device)
    cfg = model.config
    cos, sin = rope_cache(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)


class _Draws(TorchDispatchMode):
    """Records the random in-place ops (normal_, uniform_, ...) run on meta tensors, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and args and args[0].is_meta:
            self.ops.append((func, args[0], args[1:], kwargs or {}))
        return func(*args, **(kwargs or {}))


def _local_rows(full, param):
    """This rank's rows of the whole tensor `full` as FSDP2 shards `param` (torch.chunk on dim 0)."""
    local = param.to_local()
    rows = full.chunk(param.device_mesh.size())
    rank = param.device_mesh.get_local_rank()
    mine = rows[rank] if rank < len(rows) else full[:0]
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
    on the meta device, then each tensor broadcast from rank 0 in turn, each rank keeping its rows."""
    check(run)
    cfg = ckpt if isinstance(ckpt, GPTConfig) else GPTConfig.from_dict(ckpt["model_args"])
    state = ckpt["model"] if state is None else state
    model = shard(run, skeleton(cfg))
    _materialise(run, model)
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


def plain_model(cfg, state):
    """An unsharded GPT(cfg) on the CPU around the tensors of a full state dict (no copy, no init)."""
    model = skeleton(cfg)
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:   # assign=True loads the two names into two tensors
        model.lm_head.weight = model.wte.weight
    model.rope_cos, model.rope_sin = rope_cache(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
    return model


def _on_rank0(model, fn):
    """fn(plain model) on rank 0, on a copy of the whole model gathered to its CPU: the same code one
    process runs, so the same result. -> (the full state after it, on rank 0; its config and merge
    sums, on every rank)."""
    state, out = full_state(model), [None, None]
    if dist.get_rank() == 0:
        plain = plain_model(model.config, state)
        fn(plain)
        state, out = plain.state_dict(), [plain.config, plain.last_merge]
    dist.broadcast_object_list(out, src=0)
    return state, out[0], out[1]


def next_stage(run, model, opt, transition):
    """A stage boundary under FSDP: transition(model) (grow.next_stage with the stage's arguments) on
    rank 0's gathered copy, then the grown model sharded anew. The optimizer state of the parameters
    that carry over (the embeddings, final norm and head) moves to their successors of the same
    name, where train.configure_optimizer finds it. -> the new sharded model."""
    state, cfg, merged = _on_rank0(model, transition)
    new = from_state(run, cfg, state)
    new.last_merge = merged
    old = dict(model.named_parameters())
    for name, p in new.named_parameters():
        if name in old and old[name] in opt.state and old[name].shape == p.shape:
            opt.state[p] = opt.state.pop(old[name])
    # the old model is done: free its shards now, not whenever the garbage collector gets to FSDP's
    # reference cycles (measured: otherwise they outlive the next steps)
    model.to_empty(device="meta")
    return new


def merge_in_place(model, merge):
    """A ReLoRA restart under FSDP: merge(model) on rank 0's gathered copy, then loaded back into the
    same sharded parameters (the module tree is unchanged, the optimizer keeps its references)."""
    state, _, merged = _on_rank0(model, merge)
    set_model_state_dict(model, state if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model.last_merge = merged


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


def load_optimizer(opt, sd):
    """A full optimizer state dict that rank 0 read (the other ranks' is None) into the optimizer of a
    sharded model: its layout broadcast, then each state tensor shaped like its parameter broadcast
    whole in turn, each rank keeping its rows."""
    params = [p for group in opt.param_groups for p in group["params"]]
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
            mine = _local_rows(full, p)[1].clone()
            state[i][k] = DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
    opt.load_state_dict({**layout[0], "state": state})


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
