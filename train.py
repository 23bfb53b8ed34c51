"""Pre-train a GPT, vanilla or with STEP's stages, on one CPU, one GPU or many (torchrun).

  python train.py config/step_small.py                      # the default STEP run
  python train.py config/vanilla_small.py --batch_size=32   # a config file, then overrides
  torchrun --standalone --nproc_per_node=8 train.py config/step_350m.py

A run is a list of stages. Stage 1 trains a small model; at each later stage the model grows by
n_i layers (grow.py), the layers trained so far are frozen in int8 behind LoRA adapters, and the
optimizer is rebuilt over what is still trainable. Vanilla training is the same loop with one stage.

Read main() first: set up, build, then the loop (stage transition, eval and checkpoint, train step,
log). Every key and its default is in common.TrainConfig.
"""
import hashlib
import json
import math
import os
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import grow
import kernels
from common import (UserError, checkpoint_path, load_checkpoint, load_config, resume_checkpoint, run_cli,
                    save_checkpoint)
from export_hf import load_hf
from model import GPT, padded_vocab, peak_flops
from sample import sample_text

# keys that fix the model and its stages: a checkpoint resumes only under the same values
MODEL_KEYS = {"data_dir", "n_layer", "n_head", "n_embd", "ffn_hidden", "block_size", "tie_embeddings", "rope_theta",
              "norm_eps", "lora_rank", "lora_alpha", "frozen_dtype", "stage_layers", "target_layers", "n_stages", "grow_init",
              "grow_where", "train_embeddings"}
# keys that may differ between a run and its resume without changing what is computed
RESUMABLE = {"init_from", "eval_only", "dry_run", "device", "compile", "compile_cpu", "log_interval", "sample_tokens",
             "out_dir", "stop_at", "keep_checkpoints", "zero1", "sync_check_every", "activation_checkpointing",
             "loss_chunk"}


# ----------------------------------------------------------------------------------------------
# data

def load_data(data_dir, block_size):
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        raise UserError(f"no prepared data in {data_dir} (meta.json missing); run: python data/prepare.py --out {data_dir}")
    with open(meta_path) as f:
        meta = json.load(f)
    data = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise UserError(f"{path} is missing or empty; re-run: python data/prepare.py --out {data_dir}")
        arr = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        if len(arr) <= block_size + 1:
            raise UserError(f"{path} has {len(arr)} tokens, not more than block_size={block_size}+1; "
                            f"lower block_size or prepare more text")
        # a full scan is cheap up to ~1e9 tokens; beyond that trust the vocabulary in meta.json
        top = int(max(arr[i:i + 2**24].max() for i in range(0, len(arr), 2**24))) if len(arr) < 2**30 else meta["vocab_size"] - 1
        if top >= meta["vocab_size"]:
            raise UserError(f"{path} holds token id {top} >= vocab size {meta['vocab_size']}; the data was prepared "
                            f"with another tokenizer: re-run data/prepare.py or fix meta.json")
        data[split] = arr
    return data, meta


def get_batch(data, split, batch_size, block_size, seed, device):
    """A random batch that is a pure function of `seed`: resuming needs no data-loader state."""
    arr = data[split]
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(arr) - block_size - 1, (batch_size,), generator=g).tolist()
    chunk = np.stack([arr[i:i + block_size + 1].astype(np.int64) for i in ix])
    xy = torch.from_numpy(chunk)
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def batch_seed(seed, split, it, micro):
    # one reproducible stream per (split, iteration, global micro-step): the same config trains on
    # the same batches on 1 process or N ranks (rank r takes micro-steps r*A .. r*A+A-1). Not
    # hash(), which Python salts per process for strings.
    key = f"{seed}/{split}/{it}/{micro}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------------------------
# optimisation

def build_optimizer(model, cfg, device, previous=None):
    """AdamW over the trainable set: weight decay on matrices, lora_weight_decay on the adapters
    (0 by default, as LoRA and ReLoRA), none on norms. Parameters outside the layer stack
    (embeddings, final norm, head) keep their AdamW state from `previous`; everything in the stack
    is new, newly frozen or a restarted adapter, so it starts fresh."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    galore = cfg.optimizer == "galore"
    projected = {n for n, p in named if galore and n.startswith("layers.") and p.dim() == 2 and "lora_" not in n}
    groups = [{"params": [p for n, p in named if p.dim() >= 2 and "lora_" not in n and n not in projected],
               "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if n in projected], "weight_decay": cfg.weight_decay,
               "rank": cfg.galore_rank, "update_proj_gap": cfg.galore_update_proj_gap, "scale": cfg.galore_scale,
               "proj_type": "std"},
              {"params": [p for n, p in named if "lora_" in n], "weight_decay": cfg.lora_weight_decay},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    if cfg.optimizer == "adamw8bit":   # bitsandbytes' blockwise 8-bit moments (tensors under 4,096 elements: fp32)
        kw.pop("fused")
        opt = adamw8bit()(groups, **kw)
    elif galore:   # GaLore's AdamW projects the layers' matrix gradients to rank galore_rank
        try:
            from galore_torch import GaLoreAdamW
        except ImportError:
            raise UserError("optimizer=galore needs the galore-torch package: pip install galore-torch==1.0") from None
        if cfg.zero1:
            raise UserError("optimizer=galore does not shard its state: use zero1=False")
        kw.pop("fused")
        opt = GaLoreAdamW(groups, no_deprecation_warning=True, **kw)
    elif cfg.zero1 and dist.is_initialized():
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(groups, **kw)
    if previous is not None:
        carry_state(previous, opt, [p for n, p in named if not n.startswith("layers.")])
    return opt


def adamw8bit():
    """bitsandbytes' AdamW8bit class. Its CPU backend tries `from kernels import get_kernel` (Hugging
    Face's package of that name, for a 4-bit GEMM we never use), finds our kernels/ and logs a
    warning; that logger is quietened, nothing else."""
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise UserError("optimizer=adamw8bit needs the bitsandbytes package: pip install bitsandbytes==0.50.2") from None
    return bitsandbytes.optim.AdamW8bit


def local_state(opt):
    """The per-parameter state this rank holds: all of it, or under ZeRO-1 its own shard's."""
    return opt.optim.state if isinstance(opt, ZeroRedundancyOptimizer) else opt.state


def carry_state(old, new, params):
    """Hand the AdamW state of `params` from the old optimizer to the new one. Under ZeRO-1 it lives
    on the rank that owned the parameter before and goes to the rank that owns it now."""
    if not isinstance(old, ZeroRedundancyOptimizer):
        for p in params:
            if p in old.state:
                new.state[p] = old.state[p]
        return
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


def optimizer_state_dict(opt):
    """The full AdamW state dict (collective under ZeRO-1: every rank must call it). Plain AdamW and
    ZeRO-1 use the same format, so a checkpoint resumes with zero1 on or off."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if dist.get_rank() == 0 else None
    return opt.state_dict()


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


def get_lr(it, cfg, restarts, total):
    """Linear warmup, cosine decay to min_lr over the whole run, and a short linear re-warmup
    after each stage start and ReLoRA restart (`restarts`: the iterations where they happen)."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / cfg.warmup_iters
    progress = min(1.0, (it - cfg.warmup_iters) / max(1, total - cfg.warmup_iters))
    lr = cfg.min_lr + 0.5 * (cfg.learning_rate - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    since = min((it - r for r in restarts if r <= it), default=None)
    if since is not None and since < cfg.stage_warmup_iters:
        lr *= (since + 1) / cfg.stage_warmup_iters
    return lr


@torch.no_grad()
def estimate_loss(model, run):
    """Mean loss on a fixed set of eval batches, split over ranks and all-reduced. `model` is not
    the DDP wrapper: a rank with no batch (eval_iters < world) runs no forward, which under DDP
    would leave the collectives unmatched."""
    cfg = run.cfg
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = []
        for k in range(run.rank, cfg.eval_iters, run.world):
            x, y = get_batch(run.data, split, cfg.batch_size, cfg.block_size,
                             batch_seed(cfg.seed, "eval" + split, k, 0), run.device)
            with run.ctx:
                losses.append(model(x, y)[1].float())
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=run.device)
        if run.world > 1:
            dist.all_reduce(total)
        out[split] = total.item() / cfg.eval_iters
    model.train()
    return out


# ----------------------------------------------------------------------------------------------
# logging

class Logger:
    """rank-0 printing plus a JSONL metrics file."""

    def __init__(self, out_dir, master, truncate_after=None):
        self.master = master
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if master and truncate_after is not None and os.path.isfile(self.path):
            # a resumed run replays the steps after its checkpoint: drop their stale records
            with open(self.path) as f:
                keep = [l for l in f if json.loads(l).get("step", -1) <= truncate_after]
            with open(self.path, "w") as f:
                f.writelines(keep)

    def print(self, *a):
        if self.master:
            print(*a, flush=True)

    def record(self, **kv):
        if self.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(kv) + "\n")


def fmt_bytes(n):
    return f"{n / 2**20:.1f}MiB" if n < 2**30 else f"{n / 2**30:.2f}GiB"


def fmt_count(n):
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


# ----------------------------------------------------------------------------------------------
# the steps of a run

@dataclass
class Run:
    """What stays fixed for a whole run: the config, the machine, the data and the stage plan."""
    cfg: object
    device: torch.device
    rank: int
    world: int
    dtype: str
    ctx: object                 # autocast context for forward passes
    use_compile: bool
    data: dict
    meta: dict
    vocab_size: int
    tokens_per_iter: int
    stage_layers: list          # layers added per stage
    stage_iters: list
    depth: list                 # model depth in each stage
    restarts: list              # iterations where the learning rate re-warms (stage starts, ReLoRA)
    log: Logger = None

    @property
    def master(self):
        return self.rank == 0

    @property
    def total_iters(self):
        return sum(self.stage_iters)

    @property
    def resuming(self):
        return self.cfg.init_from in ("resume", "resume_previous")

    def stage_of(self, it):
        starts = [sum(self.stage_iters[:i]) for i in range(len(self.stage_iters))]
        return max(i for i, s in enumerate(starts) if s <= min(it, self.total_iters - 1))


def check_out_dir(out_dir):
    """out_dir must take files before any work is done; stale temp files of a killed save go."""
    probe = os.path.join(out_dir, ".write-test")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir={out_dir!r} is not writable ({e.strerror or e}); choose another --out_dir")
    for name in os.listdir(out_dir):
        if name.endswith(".pt.tmp"):
            os.remove(os.path.join(out_dir, name))


def setup(cfg):
    """Device and process group, precision, data (the default set is prepared on first use), and
    the stage plan."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, local, world = ((int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
                          if ddp else (0, 0, 1))
    name = cfg.device
    if name == "auto":
        name = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and ddp:
        name = f"cuda:{local}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={cfg.device} but CUDA is not available; use --device=cpu")
    device = torch.device(name)
    if cfg.gradient_accumulation_steps % world:
        raise UserError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a multiple "
                        f"of the world size {world} (each rank does an equal share)")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "bfloat16" and device.type == "cpu":
        raise UserError("dtype=bfloat16 autocast is for CUDA here; use --dtype=float32 on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if rank == 0:
        check_out_dir(cfg.out_dir)

    if not os.path.isfile(os.path.join(cfg.data_dir, "meta.json")) and cfg.data_dir.rstrip("/") == "data/shakespeare":
        if rank == 0:
            from data.prepare import prepare
            print(f"preparing the default data into {cfg.data_dir} (once)")
            prepare("shakespeare", cfg.data_dir)
        if world > 1:
            dist.barrier()
    data, meta = load_data(cfg.data_dir, cfg.block_size)
    vocab_size = padded_vocab(grow.check_vocab(cfg, meta["vocab_size"]))
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    stage_layers, stage_iters = grow.stage_plan(cfg, vocab_size, tokens_per_iter)
    starts = [sum(stage_iters[:i]) for i in range(len(stage_iters))]
    restarts = starts[1:]
    if cfg.relora_every:
        restarts += [s + k for s, n in zip(starts[1:], stage_iters[1:]) for k in range(cfg.relora_every, n, cfg.relora_every)]
    return Run(cfg, device, rank, world, dtype,
               torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext(),
               cfg.compile and (device.type == "cuda" or cfg.compile_cpu), data, meta, vocab_size, tokens_per_iter, stage_layers,
               stage_iters, [sum(stage_layers[:i + 1]) for i in range(len(stage_layers))], sorted(restarts))


def build(run):
    """The model and optimizer: fresh, resumed (everything, from out_dir's newest checkpoint, or
    the one before it) or from a checkpoint's weights (fresh optimizer and schedule).
    -> (model, optimizer, iteration, best val)."""
    cfg = run.cfg
    ckpt, it, best_val = None, 0, float("inf")
    if cfg.init_from == "scratch":
        torch.manual_seed(cfg.seed)
        model = GPT(grow.model_config(cfg, run.stage_layers[0], run.vocab_size))
    elif cfg.init_from.startswith("hf:"):   # stage 1 from a Hugging Face LLaMA folder (export_hf.py)
        torch.manual_seed(cfg.seed)
        model = load_hf(cfg.init_from[3:], grow.model_config(cfg, run.stage_layers[0], run.vocab_size),
                        "stage_layers[0]" if len(run.stage_layers) > 1 else "n_layer")
        if run.master:
            print(f"starting from {cfg.init_from} ({model.config.n_layer} layers)")
    else:
        if run.resuming:
            path, ckpt = resume_checkpoint(cfg.out_dir, previous=cfg.init_from == "resume_previous")
        else:
            path, ckpt = cfg.init_from, load_checkpoint(cfg.init_from)
        model = GPT.from_checkpoint(ckpt, path)
        if run.master:
            print(f"{'resuming' if run.resuming else 'starting'} from {path} (step {ckpt.get('iter_num', 0)})")
        if run.resuming:
            theirs = ckpt["config"]
            diff = [f"{k}={theirs.get(k)!r} (config says {v!r})" for k, v in asdict(cfg).items()
                    if k in MODEL_KEYS and theirs.get(k) != v]
            if diff:
                raise UserError(f"checkpoint {path} is of a different model: {', '.join(diff[:3])}; "
                                f"resume with the config it was trained with, or use a new out_dir")
            if theirs.get("optimizer", "adamw") != cfg.optimizer:   # the states have different layouts
                raise UserError(f"checkpoint {path} holds optimizer={theirs.get('optimizer', 'adamw')!r} state, the "
                                f"config says {cfg.optimizer!r}: resume with --optimizer={theirs.get('optimizer', 'adamw')}, "
                                f"or start from its weights with --init_from={path}")
            changed = [k for k, v in asdict(cfg).items() if k not in RESUMABLE and theirs.get(k) != v]
            if changed and run.master:
                print(f"warning: resuming with changed {', '.join(changed)}: the run will not replay exactly")
            it, best_val = ckpt["iter_num"], ckpt.get("best_val_loss", float("inf"))
        else:   # the checkpoint's depth is stage 1's; later stages still add their n_i on top
            run.depth = [d + model.config.n_layer - run.depth[0] for d in run.depth]
    if model.config.vocab_size != run.vocab_size:
        raise UserError(f"model vocab {model.config.vocab_size} does not match the data's {run.vocab_size}")
    model.to(run.device)
    opt = build_optimizer(model, cfg, run.device)
    if run.resuming:
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if run.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], run.device)
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
    run.log = Logger(cfg.out_dir, run.master, truncate_after=it if run.resuming else None)
    return model, opt, it, best_val


def describe(run):
    """The resolved config, once, and the planner's model-state bytes of each stage."""
    cfg, device = run.cfg, run.device
    peak = peak_flops(device)
    rows = [("device", f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"),
            ("dtype", run.dtype + (" (bf16 autocast, fp32 master weights)" if run.dtype == "bfloat16" else "")),
            ("compile", f"{run.use_compile}" + ("" if run.use_compile or not cfg.compile else " (off on CPU: --compile_cpu=True)")),
            ("kernels", ("triton" if kernels.use_triton(torch.empty(0, device=device)) else "pytorch reference")
             + f" (STEP_KERNELS={os.environ.get('STEP_KERNELS', 'auto')})"),
            ("world size", run.world), ("tokens/iter", f"{run.tokens_per_iter:,}"),
            ("data", f"{cfg.data_dir}: {len(run.data['train']):,} train / {len(run.data['val']):,} val tokens, "
                     f"vocab {run.meta['vocab_size']} (model {run.vocab_size})"),
            ("stages", " + ".join(map(str, run.stage_layers)) + f" layers, iters {run.stage_iters}"),
            ("peak FLOP/s", f"{peak:.3g}" if peak else "n/a (MFU not shown)")]
    rows += list(asdict(cfg).items())
    run.log.print("\n".join(f"{k:>28} : {v}" for k, v in rows))
    final = grow.model_config(cfg, run.depth[-1], run.vocab_size)
    opt = planned_optimizer(cfg)
    plan = grow.stage_memory(final, run.stage_layers, train_embeddings=cfg.train_embeddings, optimizer=opt)
    frozen = [sum(run.stage_layers[:i]) for i in range(len(run.stage_layers))]
    peaks = [grow.step_peak_bytes(final, n, f, cfg.batch_size * cfg.block_size, cfg.train_embeddings or f == 0,
                                  cfg.activation_checkpointing, cfg.loss_chunk, optimizer=opt)
             for n, f in zip(run.stage_layers, frozen)]
    run.log.print(f"planned (int8 accounting, {opt} state" + (", which GaLore's projection lowers" if cfg.optimizer ==
                  "galore" else "") + "): model state " + ", ".join(
        f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(plan)) + "; step peak with fp32 activations " +
        ", ".join(f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(peaks)))


def planned_optimizer(cfg):
    """The optimizer the planner counts: adamw8bit as it is, GaLore as the AdamW it wraps."""
    return "adamw8bit" if cfg.optimizer == "adamw8bit" else "adamw"


def merge_line(stats):
    return f"adapters merged: the int8 weights carry {100 * stats.kept:.1f}% of the update (rounding error {100 * stats.error:.1f}%)"


def enter_stage(run, model, opt, stage):
    """A stage boundary: merge, grow, freeze, then rebuild the optimizer over the new trainable set."""
    cfg = run.cfg
    n_new = run.depth[stage] - model.config.n_layer        # 0: the stage only freezes (ReLoRA)
    _, merged = grow.next_stage(model, n_new, cfg.grow_init, cfg.grow_where, seed=cfg.seed + stage,
                                train_embeddings=cfg.train_embeddings, rounding=cfg.merge_rounding)
    model.to(run.device)
    tr, fr = model.num_params()
    run.log.print(f"== stage {stage + 1}/{len(run.depth)}: grew {n_new} layers ({cfg.grow_init}, {cfg.grow_where}) "
                  f"to {model.config.n_layer}; frozen layers {list(model.config.frozen_layers)}; "
                  f"trainable {fmt_count(tr)}, frozen {fmt_count(fr)}" + (f"; {merge_line(merged)}" if merged else ""))
    return build_optimizer(model, cfg, run.device, previous=opt), merged


def relora_restart(run, model, opt, it):
    """ReLoRA inside a stage: merge the adapters into the int8 weights, restart them and their state."""
    g = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + it)
    merged = sum(model.layers[i].merge_adapters(run.cfg.merge_rounding, g) for i in model.config.frozen_layers)
    reset_adapter_state(model, opt, run.cfg.relora_prune)
    run.log.print(f"== ReLoRA restart at step {it}: {merge_line(merged)}; adapters re-initialised")
    return merged


def train_step(run, model, raw, opt, it):
    """One optimizer step over gradient_accumulation_steps micro-batches. -> (loss, grad norm, lr)."""
    cfg = run.cfg
    lr = get_lr(it, cfg, run.restarts, run.total_iters)
    for group in opt.param_groups:
        group["lr"] = lr
    accum = cfg.gradient_accumulation_steps // run.world
    for micro in range(accum):
        x, y = get_batch(run.data, "train", cfg.batch_size, cfg.block_size,
                         batch_seed(cfg.seed, "train", it, run.rank * accum + micro), run.device)
        # DDP all-reduces the gradients in the last micro-step's backward only; no_sync() is a
        # one-shot context, so it must hold the forward and the backward of one micro-step together
        with model.no_sync() if run.world > 1 and micro < accum - 1 else nullcontext():
            with run.ctx:   # [1]: the (B, T, V) logits must not outlive the forward (a name would hold them)
                loss = model(x, y)[1]
            (loss / accum).backward()
    norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    if not torch.isfinite(loss) or not torch.isfinite(norm):
        raise UserError(f"non-finite loss or gradient at step {it} (loss {loss.item()}, grad norm {norm.item()}); stopped, "
                        f"the checkpoints in {cfg.out_dir} hold the last good state: lower learning_rate and resume")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm, lr


def save(run, model, opt, it, best_val):
    """Every rank calls it (ZeRO-1 gathers the optimizer state); rank 0 writes out_dir/ckpt-<it>.pt."""
    optimizer = optimizer_state_dict(opt)
    if run.master:
        save_checkpoint(checkpoint_path(run.cfg.out_dir, it), {
            "model": model.state_dict(), "model_args": asdict(model.config), "optimizer": optimizer,
            "iter_num": it, "best_val_loss": best_val, "config": asdict(run.cfg), "meta": run.meta,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None}},
            keep=run.cfg.keep_checkpoints)
    if run.world > 1:
        dist.barrier()   # a save that failed on rank 0 must not leave the others training on


def check_replicas(run, model, when):
    """All ranks must hold bit-identical weights (DDP does not re-broadcast the int8 buffers:
    broadcast_buffers=False). A digest of every parameter and buffer, compared across ranks."""
    if run.world == 1:
        return
    h = hashlib.blake2b(digest_size=8)
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * run.world
    dist.all_gather_object(digests, h.hexdigest())
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"ranks {bad} hold other weights than rank 0 {when}; the ranks diverged (a bug: please "
                           f"report it with the config)")


class StopRequest:
    """SIGTERM or SIGINT (a pre-empted job, Ctrl-C) asks the loop to finish its step, save and exit
    cleanly; under DDP the ranks agree on the step to stop at."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def requested(self, run):
        flag = torch.tensor(float(self.signal is not None), device=run.device)
        if run.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


class Meter:
    """Step time averaged over log intervals (the first, with compile and warm-up, left out), and
    the log line."""

    def __init__(self, run):
        self.run, self.peak = run, peak_flops(run.device)
        self.t_start = self.t_last = time.time()
        self.ema_dt, self.flops_per_iter = None, None

    def log(self, it, stage, model, loss, norm, lr):
        run, cfg = self.run, self.run.cfg
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.time()
        dt = (now - self.t_last) / cfg.log_interval
        self.t_last = now
        warm = it > cfg.log_interval
        self.ema_dt = dt if self.ema_dt is None or not warm else 0.9 * self.ema_dt + 0.1 * dt
        if self.flops_per_iter is None:
            self.flops_per_iter = model.estimate_flops() * run.tokens_per_iter
        tok_s = run.tokens_per_iter / self.ema_dt
        mfu = 100 * self.flops_per_iter / self.ema_dt / (self.peak * run.world) if self.peak and warm else None
        tr, fr = model.num_params()
        plan = grow.state_bytes(model.config, train_embeddings=model.config.train_embeddings,
                                optimizer=planned_optimizer(run.cfg))
        cuda_peak = torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None
        loss_v = loss.item()
        run.log.print(f"step {it:>6}/{run.total_iters} | stage {stage + 1}/{len(run.depth)} | loss {loss_v:.4f} | "
                      f"lr {lr:.2e} | norm {norm.item():6.3f} | {1000 * dt:7.1f}ms | {tok_s:9,.0f} tok/s | "
                      f"mfu {f'{mfu:5.1f}%' if mfu is not None else '  n/a'} | train {fmt_count(tr)} frozen {fmt_count(fr)} | "
                      f"model state {fmt_bytes(plan)} (planned)"
                      + (f" | cuda peak {fmt_bytes(cuda_peak)}" if cuda_peak is not None else "")
                      + f" | eta {(run.total_iters - it) * self.ema_dt / 60:.1f}m")
        run.log.record(step=it, stage=stage + 1, loss=loss_v, lr=lr, grad_norm=norm.item(), ms_per_step=1000 * dt,
                       tokens_per_s=tok_s, mfu=mfu, trainable=tr, frozen=fr, plan_bytes=plan,
                       cuda_max_allocated=cuda_peak)


def main(argv):
    try:
        train(load_config(argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg):
    grow.check_stages(cfg)
    run = setup(cfg)
    raw, opt, it, best_val = build(run)   # `raw`: the plain module (growth, saving, sampling)
    describe(run)
    if cfg.dry_run:
        return

    def wrap(m):
        """-> (what a train step calls, what eval calls): compiled, and under DDP wrapped. DDP and
        compile must see each new parameter set. DDP does not re-broadcast buffers: the frozen int8
        weights are identical on every rank by construction, and check_replicas verifies it."""
        m = torch.compile(m) if run.use_compile else m
        if run.world == 1:
            return m, m
        return DDP(m, device_ids=[run.device.index] if run.device.type == "cuda" else None,
                   broadcast_buffers=False), m

    check_replicas(run, raw, "at the start")
    model, evaluator = wrap(raw)
    if cfg.eval_only:
        losses = estimate_loss(evaluator, run)
        run.log.print(f"eval only | train {losses['train']:.4f} | val {losses['val']:.4f}")
        return

    meter = Meter(run)
    resumed_at = it if run.resuming else None
    with StopRequest() as stop:
        while True:
            stage = run.stage_of(it)
            # a stage boundary: every layer of the earlier stages must be frozen (grow may add none)
            if stage > 0 and len(raw.config.frozen_layers) < run.depth[stage - 1]:
                opt, merged = enter_stage(run, raw, opt, stage)
                check_replicas(run, raw, f"after the growth at step {it}")
                (model, evaluator), meter.flops_per_iter = wrap(raw), None
                if merged:
                    run.log.record(step=it, stage=stage + 1, merge_kept=merged.kept, merge_error=merged.error)
            elif it in run.restarts and it != resumed_at and raw.config.frozen_layers:
                merged = relora_restart(run, raw, opt, it)
                check_replicas(run, raw, f"after the ReLoRA restart at step {it}")
                run.log.record(step=it, stage=stage + 1, merge_kept=merged.kept, merge_error=merged.error)

            last = it == run.total_iters or it == cfg.stop_at > 0
            if (it % cfg.eval_interval == 0 or last) and it != resumed_at:
                losses = estimate_loss(evaluator, run)
                best_val = min(best_val, losses["val"])
                if it > 0:
                    save(run, raw, opt, it, best_val)
                run.log.print(f"step {it:>6} | eval | train {losses['train']:.4f} | val {losses['val']:.4f} "
                              f"(best {best_val:.4f})" + (" | ckpt saved" if it > 0 else ""))
                run.log.record(step=it, stage=stage + 1, train_loss=losses["train"], val_loss=losses["val"])
            if it == cfg.stop_at > 0:
                run.log.print(f"stopped at step {it} (stop_at); continue with --init_from=resume")
                return
            if last:
                break

            loss, norm, lr = train_step(run, model, raw, opt, it)
            it += 1
            if cfg.sync_check_every and it % cfg.sync_check_every == 0:
                check_replicas(run, raw, f"after step {it}")
            if it % cfg.log_interval == 0:
                meter.log(it, stage, raw, loss, norm, lr)
            if stop.requested(run):
                save(run, raw, opt, it, best_val)
                run.log.print(f"stopped by {stop.signal or 'a signal to another rank'} after step {it}: saved "
                              f"{checkpoint_path(cfg.out_dir, it)}; continue with --init_from=resume")
                return

    device = run.device
    run.log.print(f"done: {run.total_iters} iters, {run.total_iters * run.tokens_per_iter:,} tokens in "
                  f"{(time.time() - meter.t_start) / 60:.1f} min, best val {best_val:.4f}"
                  + (f", peak cuda {fmt_bytes(torch.cuda.max_memory_allocated(device))}" if device.type == "cuda" else ""))
    if run.master and cfg.sample_tokens:
        text = sample_text(raw, run.meta, prompt="\n", max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=200,
                           seed=cfg.seed)
        path = os.path.join(cfg.out_dir, "sample.txt")
        with open(path, "w") as f:
            f.write(text)
        run.log.print(f"sample written to {path}:\n{text[:300]}")


if __name__ == "__main__":
    run_cli(main)
