"""Pre-train a GPT, vanilla or with STEP's stages, on one CPU, one GPU or many (torchrun).

  python train.py config/step_small.py                      # the default STEP run
  python train.py config/vanilla_small.py --batch_size=32   # a config file, then overrides
  torchrun --standalone --nproc_per_node=8 train.py config/step_350m.py

A run is a list of stages. Stage 1 trains a small model; at each later stage the model grows by
n_i layers (grow.py), the layers trained so far are frozen in int8 behind LoRA adapters, and the
optimizer is rebuilt over what is still trainable. Vanilla training is the same loop with one stage.
"""
import ast
import hashlib
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import grow
import kernels
from model import GPT, GPTConfig, UserError, peak_flops, run_cli


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    data_dir: str = "data/shakespeare"  # train.bin, val.bin, meta.json (data/prepare.py)
    init_from: str = "scratch"          # 'scratch', 'resume' (out_dir/ckpt.pt) or a checkpoint path (weights only)
    eval_interval: int = 100
    eval_iters: int = 20
    log_interval: int = 10
    eval_only: bool = False
    dry_run: bool = False               # print the resolved config, model and stage plan, then exit
    stop_at: int = 0                    # >0: save and stop at this iteration, as a preempted job would
    sample_tokens: int = 200            # a sample written to out_dir/sample.txt at the end (0: none)
    seed: int = 1337
    # model (the final depth comes from the stages below)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    ffn_hidden: int = 0
    block_size: int = 256
    tie_embeddings: bool = False
    lora_rank: int = 16
    lora_alpha: float = 32.0
    # STEP stages
    stage_layers: list = field(default_factory=list)  # layers added per stage, e.g. [4, 4]; [] = vanilla n_layer
    target_layers: int = 0              # or plan: final depth L split into n_stages by grow.plan_stages
    n_stages: int = 1
    stage_tokens: list = field(default_factory=list)  # token budget per stage; [] = max_iters split evenly
    grow_init: str = "mean"             # mean | copy | zero | stack
    grow_where: str = "upper"           # upper | lower | interleave | random
    train_embeddings: bool = True       # embeddings, final norm and head trainable in every stage
    relora_every: int = 0               # >0: merge + restart adapters every this many iters of a stage
    # optimisation
    batch_size: int = 16
    gradient_accumulation_steps: int = 1
    max_iters: int = 1000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 50
    stage_warmup_iters: int = 20        # re-warmup at each stage start and each ReLoRA restart
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # system
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                 # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    compile: bool = True                # torch.compile on CUDA; always off on CPU (said at start)


# ----------------------------------------------------------------------------------------------
# config: plain Python files + --key=value overrides

def _coerce(key, value, default):
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        ok = type(value) is type(default) or (isinstance(default, list) and isinstance(value, tuple))
    else:  # an int where a float is expected is fine (--learning_rate=1); a float for an int is not
        ok = type(value) is type(default) or (type(default) is float and type(value) is int)
    if not ok:
        raise UserError(f"config key {key!r} wants a {type(default).__name__}, got {value!r}; "
                        f"write it like {default!r}")
    return float(value) if type(default) is float else list(value) if isinstance(default, list) else value


def load_config(argv):
    """argv: config files (plain Python assignments) and --key=value overrides, applied in order."""
    defaults = TrainConfig()
    values = asdict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise UserError(f"override {arg!r} needs a value: write --key=value")
            key, text = arg[2:].split("=", 1)   # split once: a value may contain '='
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text                    # a bare word is a string
            updates = {key: value}
        else:
            if not os.path.isfile(arg):
                raise UserError(f"config file {arg!r} not found (see config/ for examples)")
            scope = {}
            try:
                exec(open(arg).read(), {}, scope)
            except Exception as e:
                raise UserError(f"config file {arg} does not run: {type(e).__name__}: {e}")
            updates = {k: v for k, v in scope.items() if not k.startswith("_")}
        for key, value in updates.items():
            if key not in values:
                raise UserError(f"unknown config key {key!r}; known keys are listed in TrainConfig in train.py")
            values[key] = _coerce(key, value, getattr(defaults, key))
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg):
    for key in ("batch_size", "gradient_accumulation_steps", "block_size", "eval_interval",
                "eval_iters", "log_interval", "n_head", "n_embd", "n_stages"):
        if getattr(cfg, key) < 1:
            raise UserError(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.init_from not in ("scratch", "resume") and not os.path.isfile(cfg.init_from):
        raise UserError(f"init_from={cfg.init_from!r}: use 'scratch', 'resume' or the path of a checkpoint")
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"dtype={cfg.dtype!r}: use auto, float32 or bfloat16")
    if cfg.grow_init not in grow.INITS or cfg.grow_where not in grow.PLACEMENTS:
        raise UserError(f"grow_init must be one of {grow.INITS} and grow_where one of {grow.PLACEMENTS}")
    if cfg.stage_layers and any(not isinstance(n, int) or n < 1 for n in cfg.stage_layers):
        raise UserError(f"stage_layers={cfg.stage_layers}: every stage must add at least one layer")
    if cfg.stage_layers and cfg.target_layers and sum(cfg.stage_layers) != cfg.target_layers:
        raise UserError(f"stage_layers={cfg.stage_layers} sum to {sum(cfg.stage_layers)}, "
                        f"not target_layers={cfg.target_layers}; fix one of them")
    if cfg.max_iters < 1 and not cfg.stage_tokens:
        raise UserError("max_iters must be >= 1 (or give stage_tokens)")
    n_stages = len(cfg.stage_layers) or cfg.n_stages
    if n_stages > 1 and not 1 <= cfg.lora_rank <= cfg.n_embd:
        raise UserError(f"lora_rank={cfg.lora_rank} must be between 1 and n_embd={cfg.n_embd}")


def model_config(cfg, n_layer, vocab_size):
    return GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, ffn_hidden=cfg.ffn_hidden, tie_embeddings=cfg.tie_embeddings,
                     lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)


def resolve_stages(cfg, vocab_size, tokens_per_iter):
    """-> (layers added per stage, iterations per stage)."""
    if cfg.stage_layers:
        layers = list(cfg.stage_layers)
    elif cfg.target_layers:
        mcfg = model_config(cfg, cfg.target_layers, vocab_size)
        layers = grow.plan_stages(mcfg, cfg.target_layers, cfg.n_stages, train_embeddings=cfg.train_embeddings)
    else:
        layers = [cfg.n_layer] if cfg.n_stages == 1 else None
        if layers is None:
            raise UserError("n_stages > 1 needs target_layers (planned) or stage_layers (explicit)")
    if cfg.stage_tokens:
        if len(cfg.stage_tokens) != len(layers):
            raise UserError(f"stage_tokens has {len(cfg.stage_tokens)} entries for {len(layers)} stages")
        iters = [max(1, math.ceil(t / tokens_per_iter)) for t in cfg.stage_tokens]
    else:
        k = len(layers)
        if cfg.max_iters < k:
            raise UserError(f"max_iters={cfg.max_iters} is fewer than the {k} stages")
        iters = [cfg.max_iters // k] * k
        iters[-1] += cfg.max_iters - sum(iters)
    return layers, iters


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


def batch_seed(seed, split, it, micro, rank):
    # distinct, reproducible streams per (split, iteration, micro-step, rank); not hash(), which
    # Python salts per process for strings
    key = f"{seed}/{split}/{it}/{micro}/{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------------------------
# optimisation

def build_optimizer(model, cfg, device, previous=None):
    """AdamW over the trainable set; weight decay on matrices only. Parameters outside the layer
    stack (embeddings, final norm, head) keep their AdamW state from `previous`; everything in the
    stack is new, newly frozen or a restarted adapter, so it starts fresh."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                            fused=device.type == "cuda")
    if previous is not None:
        for name, p in named:
            if not name.startswith("layers.") and p in previous.state:
                opt.state[p] = previous.state[p]
    return opt


def reset_adapter_state(model, opt):
    for name, p in model.named_parameters():
        if "lora_" in name:
            opt.state.pop(p, None)


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
def estimate_loss(model, data, cfg, ctx, device, rank, world):
    """Mean loss on a fixed set of eval batches, split over ranks and all-reduced."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = []
        for k in range(rank, cfg.eval_iters, world):
            x, y = get_batch(data, split, cfg.batch_size, cfg.block_size, batch_seed(cfg.seed, "eval" + split, k, 0, 0), device)
            with ctx:
                losses.append(model(x, y)[1].float())
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
        if world > 1:
            dist.all_reduce(total)
        out[split] = total.item() / cfg.eval_iters
    model.train()
    return out


# ----------------------------------------------------------------------------------------------
# checkpoints

def save_checkpoint(path, state):
    """Write to a temp file in the same folder, flush to disk, then rename: a crash or kill at any
    moment leaves either the old checkpoint or the new one, never a torn file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (corrupt or truncated: {type(e).__name__}); "
                        f"delete it and start with init_from=scratch, or restore a copy")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    return ckpt


def model_from_checkpoint(ckpt, path):
    model = GPT(GPTConfig.from_dict(ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in ckpt["model"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise UserError(f"checkpoint {path} does not match its own model config ({first}); it is damaged")
    return model


# ----------------------------------------------------------------------------------------------

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


def setup_device(cfg):
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, local, world = 0, 0, 1
    name = cfg.device
    if name == "auto":
        name = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and ddp:
        name = f"cuda:{local}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={cfg.device} but CUDA is not available; use --device=cpu")
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device, rank, world


def run(argv):
    cfg = load_config(argv)
    device, rank, world = setup_device(cfg)
    master = rank == 0
    if cfg.gradient_accumulation_steps % world:
        raise UserError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a multiple "
                        f"of the world size {world} (each rank does an equal share)")
    accum = cfg.gradient_accumulation_steps // world
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "bfloat16" and device.type == "cpu":
        raise UserError("dtype=bfloat16 autocast is for CUDA here; use --dtype=float32 on CPU")
    use_compile = cfg.compile and device.type == "cuda"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    # data: the default Shakespeare set is prepared on first use
    if not os.path.isfile(os.path.join(cfg.data_dir, "meta.json")) and cfg.data_dir.rstrip("/") == "data/shakespeare":
        if master:
            from data.prepare import prepare
            print(f"preparing the default data into {cfg.data_dir} (once)")
            prepare("shakespeare", cfg.data_dir)
        if world > 1:
            dist.barrier()
    data, meta = load_data(cfg.data_dir, cfg.block_size)
    vocab_size = 64 * math.ceil(meta["vocab_size"] / 64)
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    stage_layers, stage_iters = resolve_stages(cfg, vocab_size, tokens_per_iter)
    total_iters = sum(stage_iters)
    stage_start = [sum(stage_iters[:i]) for i in range(len(stage_iters))]
    depth = [sum(stage_layers[:i + 1]) for i in range(len(stage_layers))]
    restarts = stage_start[1:]   # where the learning rate re-warms: stage starts and ReLoRA restarts
    if cfg.relora_every:
        restarts += [s + k for s, n in zip(stage_start[1:], stage_iters[1:]) for k in range(cfg.relora_every, n, cfg.relora_every)]

    # model: fresh, resumed (everything) or from a checkpoint's weights (fresh optimizer and schedule)
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt, it = None, 0
    if cfg.init_from == "scratch":
        torch.manual_seed(cfg.seed)
        model = GPT(model_config(cfg, stage_layers[0], vocab_size))
    else:
        path = ckpt_path if cfg.init_from == "resume" else cfg.init_from
        ckpt = load_checkpoint(path)
        model = model_from_checkpoint(ckpt, path)
        if cfg.init_from == "resume":
            theirs = ckpt["config"]
            diff = [f"{k}={theirs.get(k)!r} (config says {v!r})" for k, v in asdict(cfg).items()
                    if k in MODEL_KEYS and theirs.get(k) != v]
            if diff:
                raise UserError(f"checkpoint {path} is of a different model: {', '.join(diff[:3])}; "
                                f"resume with the config it was trained with, or use a new out_dir")
            changed = [k for k, v in asdict(cfg).items() if k not in RESUMABLE and theirs.get(k) != v]
            if changed and master:
                print(f"warning: resuming with changed {', '.join(changed)}: the run will not replay exactly")
            it = ckpt["iter_num"]
    if cfg.init_from not in ("scratch", "resume"):
        # the checkpoint's depth is stage 1's; later stages still add their n_i on top
        depth = [d + model.config.n_layer - depth[0] for d in depth]
    if model.config.vocab_size != vocab_size:
        raise UserError(f"model vocab {model.config.vocab_size} does not match the data's {vocab_size}")
    model.to(device)
    opt = build_optimizer(model, cfg, device)
    if ckpt is not None and cfg.init_from == "resume":
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
    best_val = ckpt.get("best_val_loss", float("inf")) if ckpt and cfg.init_from == "resume" else float("inf")
    log = Logger(cfg.out_dir, master, truncate_after=it if cfg.init_from == "resume" else None)

    # the resolved config, once
    peak = peak_flops(device)
    rows = [("device", f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"),
            ("dtype", dtype + (" (bf16 autocast, fp32 master weights)" if dtype == "bfloat16" else "")),
            ("compile", f"{use_compile}" + ("" if use_compile or not cfg.compile else " (off: CPU)")),
            ("kernels", ("triton" if kernels.use_triton(torch.empty(0, device=device)) else "pytorch reference")
             + f" (STEP_KERNELS={os.environ.get('STEP_KERNELS', 'auto')})"),
            ("world size", world), ("tokens/iter", f"{tokens_per_iter:,}"),
            ("data", f"{cfg.data_dir}: {len(data['train']):,} train / {len(data['val']):,} val tokens, vocab {meta['vocab_size']} (model {vocab_size})"),
            ("stages", " + ".join(map(str, stage_layers)) + f" layers, iters {stage_iters}"),
            ("peak FLOP/s", f"{peak:.3g}" if peak else "n/a (MFU not shown)")]
    rows += [(k, v) for k, v in asdict(cfg).items()]
    log.print("\n".join(f"{k:>28} : {v}" for k, v in rows))
    log.print("plan (int8 accounting): " + ", ".join(
        f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(grow.stage_memory(model_config(cfg, depth[-1], vocab_size), stage_layers, train_embeddings=cfg.train_embeddings))))
    if cfg.dry_run:
        return

    def wrap(m):   # what the loop calls; `raw` stays the plain module for growth, saving, sampling
        m = torch.compile(m) if use_compile else m
        return DDP(m, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else m

    raw, model = model, wrap(model)

    def checkpoint(step):
        if not master:
            return
        save_checkpoint(ckpt_path, {
            "model": raw.state_dict(), "model_args": asdict(raw.config), "optimizer": opt.state_dict(),
            "iter_num": step, "best_val_loss": best_val, "config": asdict(cfg), "meta": meta,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}})

    if cfg.eval_only:
        losses = estimate_loss(model, data, cfg, ctx, device, rank, world)
        log.print(f"eval only | train {losses['train']:.4f} | val {losses['val']:.4f}")
        return

    flops_per_iter = None
    t_start, t_last, ema_dt = time.time(), time.time(), None
    resumed_at = it if cfg.init_from == "resume" else None
    while True:
        stage = max(i for i, s in enumerate(stage_start) if s <= min(it, total_iters - 1))
        if raw.config.n_layer < depth[stage]:   # a stage boundary: grow, freeze, rebuild the optimizer
            n_new = depth[stage] - raw.config.n_layer
            grow.next_stage(raw, n_new, cfg.grow_init, cfg.grow_where, seed=cfg.seed + stage,
                            train_embeddings=cfg.train_embeddings)
            raw.to(device)
            opt = build_optimizer(raw, cfg, device, previous=opt)
            model = wrap(raw)   # DDP and compile must see the new parameter set
            tr, fr = raw.num_params()
            log.print(f"== stage {stage + 1}/{len(depth)}: grew {n_new} layers ({cfg.grow_init}, {cfg.grow_where}) "
                      f"to {raw.config.n_layer}; frozen layers {list(raw.config.frozen_layers)}; "
                      f"trainable {fmt_count(tr)}, frozen {fmt_count(fr)}")
            flops_per_iter = None
        elif it in restarts and it != resumed_at and raw.config.frozen_layers:   # ReLoRA restart
            for i in raw.config.frozen_layers:
                raw.layers[i].merge_adapters()
            reset_adapter_state(raw, opt)
            log.print(f"== ReLoRA restart at step {it}: adapters merged into int8 weights and re-initialised")
        if flops_per_iter is None:
            flops_per_iter = raw.estimate_flops() * tokens_per_iter
            plan_bytes = grow.state_bytes(raw.config, train_embeddings=raw.config.train_embeddings)

        last = it == total_iters or it == cfg.stop_at > 0
        if (it % cfg.eval_interval == 0 or last) and it != resumed_at:
            losses = estimate_loss(model, data, cfg, ctx, device, rank, world)
            best_val = min(best_val, losses["val"])
            saved = it > 0
            if saved:
                checkpoint(it)
            log.print(f"step {it:>6} | eval | train {losses['train']:.4f} | val {losses['val']:.4f} "
                      f"(best {best_val:.4f})" + (" | ckpt saved" if saved else ""))
            log.record(step=it, stage=stage + 1, train_loss=losses["train"], val_loss=losses["val"])
        if it == cfg.stop_at > 0:
            log.print(f"stopped at step {it} (stop_at); continue with --init_from=resume")
            return
        if last:
            break

        lr = get_lr(it, cfg, restarts, total_iters)
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            x, y = get_batch(data, "train", cfg.batch_size, cfg.block_size,
                             batch_seed(cfg.seed, "train", it, micro, rank), device)
            sync = nullcontext() if world == 1 or micro == accum - 1 else model.no_sync()
            with sync, ctx:
                _, loss = model(x, y)
            with sync:
                (loss / accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if not torch.isfinite(loss) or not torch.isfinite(norm):
            raise UserError(f"non-finite loss or gradient at step {it} (loss {loss.item()}, grad norm {norm.item()}); stopped, "
                            f"{ckpt_path} still holds the last good state: lower learning_rate and resume")
        opt.step()
        measured = grow.measured_state_bytes(raw, opt) if (it + 1) % cfg.log_interval == 0 else None
        opt.zero_grad(set_to_none=True)
        it += 1

        if measured is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            dt = (now - t_last) / cfg.log_interval
            t_last = now
            warm = it > cfg.log_interval   # the first interval holds compile and warm-up: not averaged
            ema_dt = dt if ema_dt is None or not warm else 0.9 * ema_dt + 0.1 * dt
            tok_s = tokens_per_iter / ema_dt
            mfu = f"{100 * flops_per_iter / ema_dt / (peak * world):5.1f}%" if peak and warm else "  n/a"
            eta = (total_iters - it) * ema_dt
            tr, fr = raw.num_params()
            cuda_mem = f" | cuda {fmt_bytes(torch.cuda.max_memory_allocated(device))}" if device.type == "cuda" else ""
            loss_v = loss.item()
            log.print(f"step {it:>6}/{total_iters} | stage {stage + 1}/{len(depth)} | loss {loss_v:.4f} | lr {lr:.2e} | "
                      f"norm {norm.item():6.3f} | {1000 * dt:7.1f}ms | {tok_s:9,.0f} tok/s | mfu {mfu} | "
                      f"train {fmt_count(tr)} frozen {fmt_count(fr)} | state {fmt_bytes(measured)} (plan {fmt_bytes(plan_bytes)})"
                      f"{cuda_mem} | eta {eta / 60:.1f}m")
            log.record(step=it, stage=stage + 1, loss=loss_v, lr=lr, grad_norm=norm.item(), ms_per_step=1000 * dt,
                       tokens_per_s=tok_s, mfu=float(mfu.strip("% ")) if peak and warm else None,
                       trainable=tr, frozen=fr, state_bytes=measured, plan_bytes=plan_bytes,
                       cuda_max_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)

    log.print(f"done: {total_iters} iters, {total_iters * tokens_per_iter:,} tokens in {(time.time() - t_start) / 60:.1f} min, "
              f"best val {best_val:.4f}" + (f", peak cuda {fmt_bytes(torch.cuda.max_memory_allocated(device))}" if device.type == "cuda" else ""))
    if master and cfg.sample_tokens:
        from sample import sample_text
        text = sample_text(raw, meta, prompt="\n", max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=200, seed=cfg.seed)
        with open(os.path.join(cfg.out_dir, "sample.txt"), "w") as f:
            f.write(text)
        log.print(f"sample written to {os.path.join(cfg.out_dir, 'sample.txt')}:\n{text[:300]}")


# keys that fix the model and its stages: a checkpoint resumes only under the same values
MODEL_KEYS = {"data_dir", "n_layer", "n_head", "n_embd", "ffn_hidden", "block_size", "tie_embeddings",
              "lora_rank", "lora_alpha", "stage_layers", "target_layers", "n_stages", "grow_init",
              "grow_where", "train_embeddings"}
# keys that may differ between a run and its resume without changing what is computed
RESUMABLE = {"init_from", "eval_only", "dry_run", "device", "compile", "log_interval", "sample_tokens",
             "out_dir", "stop_at"}


def main(argv):
    try:
        run(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
