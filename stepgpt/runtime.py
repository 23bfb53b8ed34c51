"""The infrastructure of a training run, beside the loop in train.py: the out_dir lock, checkpoints
with their RNG states and the checks before a resume, signals (a pre-empted job saves and stops),
replica digests under DDP, the resolved-config table, the meter and the log line."""
import hashlib
import json
import os
import random
import signal
import socket
import time
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist

import frozen_linear
import grow
from model import FrozenLoRALinear, GPTConfig, merge_quality
from stepgpt import kernels, memory, optim
from stepgpt.checkpoint import checkpoint_path, save_checkpoint
from stepgpt.config import RUNTIME_KEYS, STAGE_KEYS
from stepgpt.errors import UserError

try:
    import fcntl
except ImportError:   # Windows: no advisory locks, out_dir is not guarded
    fcntl = None


class OutDirLock:
    """out_dir/run.lock, held while a run lives, so that a second run into the same out_dir (a job
    launched twice, a requeue while the old job still dies) stops at once. flock is released by the
    OS when the process dies: a killed run leaves nothing stuck. Also proves out_dir writable."""

    def __init__(self, out_dir):
        self.f = None
        try:
            os.makedirs(out_dir, exist_ok=True)
            f = open(os.path.join(out_dir, "run.lock"), "a+")
        except OSError as e:
            raise UserError(f"out_dir={out_dir!r} is not writable ({e.strerror or e}); "
                            f"choose another --out_dir") from None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise UserError(f"out_dir={out_dir!r} is in use by another run ({holder}); wait for it to "
                                f"end or stop it, or choose another --out_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self.f = f
        for name in os.listdir(out_dir):   # a save killed halfway left its temp file (ours now)
            if name.endswith(".pt.tmp"):
                os.remove(os.path.join(out_dir, name))

    def release(self):
        if self.f is not None:
            self.f.close()   # closing the file releases the lock
            self.f = None


def save(run, model, opt, it, best_val):
    """Every rank calls it (ZeRO-1 gathers the optimizer state); rank 0 writes out_dir/ckpt-<it>.pt."""
    optimizer = optim.state_dict(opt)
    if run.master:
        save_checkpoint(checkpoint_path(run.cfg.out_dir, it), {
            "model": model.state_dict(), "model_args": asdict(model.config), "optimizer": optimizer,
            "iter_num": it, "best_val_loss": best_val, "config": asdict(run.cfg), "meta": run.meta,
            "kernels": kernels.state(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None}},
            keep=run.cfg.keep_checkpoints)
    if run.world > 1:
        dist.barrier()   # a save that failed on rank 0 must not leave the others training on


def check_resume(path, ckpt, cfg):
    """A checkpoint resumes only under the config it was trained with: the model's keys, the stages
    and the data must match, the optimizer too (its state's layout differs); other changes warn.
    -> the keys that changed (the run will not replay exactly)."""
    theirs = ckpt["config"]
    fixed = {f.name for f in fields(GPTConfig)} | STAGE_KEYS
    diff = [f"{k}={theirs.get(k)!r} (config says {v!r})" for k, v in asdict(cfg).items()
            if k in fixed - RUNTIME_KEYS and theirs.get(k) != v]
    if diff:
        raise UserError(f"checkpoint {path} is of a different model: {', '.join(diff[:3])}; resume with the "
                        f"config it was trained with, or use a new out_dir")
    written_by = theirs.get("optimizer", "adamw")
    if written_by != cfg.optimizer:
        raise UserError(f"checkpoint {path} holds optimizer={written_by!r} state, the config says "
                        f"{cfg.optimizer!r}: resume with --optimizer={written_by}, or start from its weights "
                        f"with --init_from={path}")
    return [k for k, v in asdict(cfg).items() if k not in RUNTIME_KEYS and theirs.get(k) != v]


def restore(ckpt, device):
    """What a resumed run takes back besides the model and optimizer: the RNG states, and the
    kernels' measured paths and tuned configs (so it computes the same way)."""
    kernels.load_state(ckpt.get("kernels", {}))
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    np.random.set_state(ckpt["rng"]["numpy"])
    random.setstate(ckpt["rng"]["python"])


def measure_kernels(model, device, dtype, tokens):
    """On CUDA, time the paths of every frozen-linear shape that a micro-batch of `tokens` tokens in
    `dtype` takes and that is not measured yet (kernels.measure, on the layer's own weights;
    collective under DDP)."""
    if device.type != "cuda":
        return
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    for m in model.modules():
        if isinstance(m, FrozenLoRALinear):
            x = torch.randn(tokens, m.in_features, dtype=dt, device=device)
            with torch.enable_grad():   # as a training call: measured if it may run Triton
                kernels.choose_path(x, m.weight_q, m.weight_scale, m.lora_a, m.lora_b, m.lora_scale,
                                    (frozen_linear.forward, frozen_linear.backward))


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
        raise RuntimeError(f"ranks {bad} hold other weights than rank 0 {when}; the ranks diverged (a bug: "
                           f"please report it with the config)")


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


class Logger:
    """rank-0 printing plus a JSONL metrics file."""

    def __init__(self, out_dir, master, truncate_after=None):
        self.master = master
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if master and truncate_after is not None and os.path.isfile(self.path):
            # a resumed run replays the steps after its checkpoint: drop their stale records
            with open(self.path) as f:
                keep = [line for line in f if json.loads(line).get("step", -1) <= truncate_after]
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


def describe(run):
    """The resolved config, once, and the planner's model-state bytes and step peak of each stage."""
    cfg, device = run.cfg, run.device
    peak = peak_flops(device)
    off = "" if run.compiled or not cfg.compile else " (off on CPU: --compile_cpu=True)"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bf16 = " (bf16 autocast, fp32 master weights)" if run.dtype == "bfloat16" else ""
    triton = kernels.use_triton(torch.empty(0, device=device))
    data = run.data
    rows = [("device", f"{device} ({name})"), ("dtype", run.dtype + bf16),
            ("compile", f"{run.compiled}{off}"),
            ("kernels", ("triton" if triton else "pytorch reference")
             + f" (STEP_KERNELS={os.environ.get('STEP_KERNELS', 'auto')})"),
            ("world size", run.world), ("tokens/iter", f"{run.tokens_per_iter:,}"),
            ("data", f"{cfg.data_dir}: {len(data['train']):,} train / {len(data['val']):,} val tokens, "
                     f"vocab {run.meta['vocab_size']} (model {run.vocab_size})"),
            ("stages", " + ".join(map(str, run.stage_layers)) + f" layers, iters {run.stage_iters}"),
            ("peak FLOP/s", f"{peak:.3g}" if peak else "n/a (MFU not shown)")]
    rows += list(asdict(cfg).items())
    run.log.print("\n".join(f"{k:>28} : {v}" for k, v in rows))
    final = grow.model_config(cfg, run.depth[-1], run.vocab_size)
    opt = planned_optimizer(cfg)
    plan = grow.stage_memory(final, run.stage_layers, memory.state_bytes,
                             train_embeddings=cfg.train_embeddings, optimizer=opt)
    peaks = memory.configured_peaks(cfg, final, run.stage_layers, run.dtype)
    galore = ", which GaLore's projection lowers" if cfg.optimizer == "galore" else ""
    run.log.print(f"planned (int8 accounting, {opt} state{galore}): model state "
                  + ", ".join(f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(plan))
                  + f"; step peak with {run.dtype} activations "
                  + ", ".join(f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(peaks)))
    if device.type == "cuda":
        warning = memory_warning(max(peaks), torch.cuda.mem_get_info(device)[0], device)
        if warning:
            run.log.print(warning)


def memory_warning(planned, free, device):
    """A line when the planned step peak is over the device's free memory, naming what to change."""
    if planned <= free:
        return None
    return (f"warning: the planned step peak, {fmt_bytes(planned)}, is over the {fmt_bytes(free)} free on "
            f"{device}: lower batch_size (raising gradient_accumulation_steps keeps the tokens per step), or "
            f"set activation_checkpointing=True, loss_chunk=block_size, optimizer=adamw8bit; python plan.py "
            f"CONFIG shows what each saves")


def planned_optimizer(cfg):
    """The optimizer the planner counts: adamw8bit as it is, GaLore as the AdamW it wraps."""
    return "adamw8bit" if cfg.optimizer == "adamw8bit" else "adamw"


def log_stage(run, model, stage, n_new, merged):
    cfg, (tr, fr) = run.cfg, model.num_params()
    run.log.print(f"== stage {stage + 1}/{len(run.depth)}: grew {n_new} layers ({cfg.grow_init}, "
                  f"{cfg.grow_where}) to {model.config.n_layer}; frozen layers "
                  f"{list(model.config.frozen_layers)}; trainable {fmt_count(tr)}, frozen "
                  f"{fmt_count(fr)}" + ("" if merged is None else f"; {merge_line(merged)}"))


def merge_record(sums):
    kept, error = merge_quality(sums)
    return {"merge_kept": kept, "merge_error": error}


def merge_line(sums):
    kept, error = merge_quality(sums)
    return (f"adapters merged: the int8 weights carry {100 * kept:.1f}% of the update (rounding error "
            f"{100 * error:.1f}%)")


# MFU denominators: dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity)
PEAK_FLOPS = {"H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "GH200": 989e12,
              "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12}


def peak_flops(device):
    """Peak bf16 FLOP/s of a CUDA device by name, or None (CPU, unknown GPU: MFU shows n/a)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():   # dict order puts specific names before their prefixes
        if key in name:
            return value
    return None


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
        mfu = None
        if self.peak and warm:
            mfu = 100 * self.flops_per_iter / self.ema_dt / (self.peak * run.world)
        tr, fr = model.num_params()
        plan = memory.state_bytes(model.config, train_embeddings=model.config.train_embeddings,
                                  optimizer=planned_optimizer(run.cfg))
        cuda_peak = torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None
        loss_v = loss.item()
        mfu_s = f"{mfu:5.1f}%" if mfu is not None else "  n/a"
        cuda_s = f" | cuda peak {fmt_bytes(cuda_peak)}" if cuda_peak is not None else ""
        eta = (run.total_iters - it) * self.ema_dt / 60
        run.log.print(f"step {it:>6}/{run.total_iters} | stage {stage + 1}/{len(run.depth)} | loss "
                      f"{loss_v:.4f} | lr {lr:.2e} | norm {norm.item():6.3f} | {1000 * dt:7.1f}ms | "
                      f"{tok_s:9,.0f} tok/s | mfu {mfu_s} | train {fmt_count(tr)} frozen {fmt_count(fr)} | "
                      f"model state {fmt_bytes(plan)} (planned){cuda_s} | eta {eta:.1f}m")
        run.log.record(step=it, stage=stage + 1, loss=loss_v, lr=lr, grad_norm=norm.item(),
                       ms_per_step=1000 * dt, tokens_per_s=tok_s, mfu=mfu, trainable=tr, frozen=fr,
                       plan_bytes=plan, cuda_max_allocated=cuda_peak)


