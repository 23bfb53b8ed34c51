"""What a run shows and records: the resolved config and the plan (describe), the log line with
loss, lr, tokens/s, MFU and ETA (Meter), and metrics.jsonl, one JSON record per log and eval step
(Logger), which the trackers a config turns on (TensorBoard, W&B) get too. Rank 0 only."""
import json
import math
import os
import re
import time
from dataclasses import asdict

import numpy as np
import torch

import grow
from model import GPT, merge_quality
from stepgpt import kernels, memory, runtime
from stepgpt.checkpoint import checkpoint_files, checkpoint_step, load_checkpoint, written
from stepgpt.errors import UserError


def read_metrics(path):
    """-> (the records of a metrics.jsonl, how many lines were dropped): a line a kill tore in the
    middle of a write, or left blank, is not a record."""
    records, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                dropped += 1
    return records, dropped


class Logger:
    """Rank-0 printing, out_dir/metrics.jsonl (one JSON record per log and eval step) and the
    trackers: each record goes to them as scalars named by its keys, at its step; the log lines that
    begin a stage or a ReLoRA restart (print's mark) and the resolved config (config) go too.
    A resumed run keeps the records up to its checkpoint's step (keep_until) and drops those after
    it, which it replays; a fresh run (keep_until=-1) starts the file anew (checkpoint.claim has made
    sure the folder holds no other run's checkpoints). The file is rewritten atomically."""

    def __init__(self, cfg, master, keep_until, wandb_id=None):
        self.master = master
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.wandb_id = wandb_id     # the checkpoint keeps it: a resumed run continues the same W&B run
        self.trackers, self.written = [], {}
        sent = keep_until            # the last step the run's earlier attempts recorded
        if master and os.path.isfile(self.path) and not cfg.dry_run:
            records, dropped = read_metrics(self.path)
            keep = [r for r in records if r.get("step", -1) <= keep_until]
            if dropped or len(keep) < len(records):
                what = "replaced (a fresh run)" if keep_until < 0 else f"kept up to step {keep_until}"
                torn = f"; {dropped} torn or blank line(s) dropped" if dropped else ""
                print(f"{self.path}: {what}{torn}", flush=True)
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(self.path + ".tmp", self.path)
            sent = max([r.get("step", -1) for r in records] + [keep_until])
        if not master or cfg.dry_run or cfg.eval_only:
            return
        resume_step = keep_until if keep_until >= 0 else None
        if cfg.tensorboard_dir:
            self.trackers.append(TensorBoard(cfg.tensorboard_dir, resume_step))
        if cfg.wandb_log:
            self.trackers.append(WandB(cfg, wandb_id, sent if resume_step is not None else None))
            self.wandb_id = self.trackers[-1].run.id

    def print(self, *a, mark=None):
        """Rank 0 prints; with `mark` (a step), the line also goes on the trackers' timeline at that
        step (a stage boundary, a ReLoRA restart)."""
        if self.master:
            print(*a, flush=True)
        if mark is not None:
            for tracker in self.trackers:
                tracker.text(mark, " ".join(map(str, a)))

    def record(self, **kv):
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(kv) + "\n")
        step = kv["step"]
        # one value per name and step: at a stage boundary the step's training record, the merge and
        # the eval all carry `stage`; the first is kept (the training record's, where the step logs)
        scalars = {k: v for k, v in kv.items()
                   if k != "step" and v is not None and self.written.get(k, -1) < step}
        self.written.update(dict.fromkeys(scalars, step))
        for tracker in self.trackers:
            tracker.scalars(step, scalars)

    def config(self, values):
        for tracker in self.trackers:
            tracker.config(values)

    def close(self, failed=False):
        for tracker in self.trackers:
            tracker.close(failed)


class TensorBoard:
    """TensorBoard's event files (torch's SummaryWriter). A resumed run purges the steps after its
    checkpoint (purge_step), and a fresh one every step (an earlier attempt killed before its first
    checkpoint): readers drop what an earlier attempt wrote from there on, as the run drops those
    records from metrics.jsonl, so no step appears twice."""

    def __init__(self, folder, resume_step):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("tensorboard_dir is set but TensorBoard is not installed: pip install "
                            "tensorboard==2.21.0 (or leave tensorboard_dir empty)") from None
        self.start = 0 if resume_step is None else resume_step + 1   # the first step this attempt trains
        try:
            self.writer = SummaryWriter(folder, purge_step=self.start)
        except OSError as e:
            raise UserError(f"tensorboard_dir={folder!r} cannot be written ({e.strerror or e}); give a "
                            f"writable folder") from None

    def scalars(self, step, values):
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def text(self, step, line):
        self.writer.add_text("events", line, step)

    def config(self, values):
        rows = "".join(f"| {k} | {v} |\n" for k, v in values.items())
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows, self.start)

    def close(self, failed):
        self.writer.close()


# seconds wandb.init waits for the server before the run goes offline; the end of the run waits as
# long at most for its uploads (what is left is in the run folder's transaction log, for `wandb sync`)
WANDB_TIMEOUT = 30


class WandB:
    """A Weights & Biases run in out_dir/wandb, or in $WANDB_DIR/wandb where that is set (W&B's own
    variable, which clusters point at a scratch disk). It never stops or holds up training: without an API
    key it is offline from the start (no prompt, no wait), and a server that does not answer within
    WANDB_TIMEOUT seconds makes it offline too; either way one line says so, and `wandb sync` uploads
    the run folder later. W&B keeps the steps it has been sent (a run's steps only grow): a run that
    continues a W&B run (`run_id`) sends those after the last step its earlier attempts recorded
    (`after`)."""

    def __init__(self, cfg, run_id, after):
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_log=True but wandb is not installed: pip install wandb==0.31.0 (or "
                            "--wandb_log=False)") from None
        self.after = after if run_id is not None and after is not None else -1
        name = cfg.wandb_run_name or os.path.basename(os.path.abspath(cfg.out_dir))
        kw = dict(project=cfg.wandb_project, name=name, id=run_id, resume="allow" if run_id else None,
                  dir=os.environ.get("WANDB_DIR") or cfg.out_dir,
                  settings=wandb.Settings(init_timeout=WANDB_TIMEOUT, finish_timeout=WANDB_TIMEOUT))
        why = f"WANDB_MODE={os.environ['WANDB_MODE']}" if os.environ.get("WANDB_MODE") else None
        if why is None and not wandb.login(prompt=False, verify=False):
            why = "no W&B API key: `wandb login` or WANDB_API_KEY"
            kw["mode"] = "offline"
        try:
            self.run = wandb.init(**kw)
        except wandb.errors.Error as e:   # the server did not answer in time, or refused the key
            why = f"the W&B server could not be used: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}"
            self.run = wandb.init(**{**kw, "mode": "offline"})
        if self.run.offline:
            folder = os.path.dirname(self.run.dir)
            print(f"wandb: offline ({why}); the run is in {folder}: upload it with `wandb sync {folder}`",
                  flush=True)

    def scalars(self, step, values):
        if step > self.after:
            self.run.log(values, step=step)

    def text(self, step, line):
        pass   # W&B keeps the console's lines; its `stage` scalar marks the boundaries

    def config(self, values):
        self.run.config.update(values, allow_val_change=True)

    def close(self, failed):
        self.run.finish(exit_code=1 if failed else 0)


# a trained LLM's weights, norm gains included, stay within about +-10^2; far beyond it they diverged
SANE_WEIGHT = 1e4


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for x in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(x)


def why_not_resumable(path, data):
    """None if training can go on from the checkpoint at `path`, else why not (a phrase): its weights
    and optimizer state must be finite, its weights within +-SANE_WEIGHT, and a forward and backward
    pass of its model on one sequence of the run's training data `data` must give a finite loss and
    gradient. On the CPU, off the run's device: the run's model still holds the device's memory."""
    try:
        ckpt = load_checkpoint(path)
        model = GPT.from_checkpoint(ckpt, path)
    except UserError as e:
        return str(e)
    weights = [t for t in _tensors(ckpt["model"]) if t.is_floating_point()]
    if not all(torch.isfinite(t).all() for t in weights + [t for t in _tensors(ckpt["optimizer"])
                                                            if t.is_floating_point()]):
        return "non-finite weights or optimizer state"
    top = max((t.abs().max().item() for t in weights if t.numel()), default=0.0)
    if top > SANE_WEIGHT:
        return f"weights up to {top:.3g}"
    T = model.config.block_size
    xy = torch.from_numpy(data[:T + 1].astype(np.int64))[None]
    loss = model(xy[:, :-1], xy[:, 1:])[1]
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    if not (torch.isfinite(loss) and torch.isfinite(norm)):
        return f"a non-finite gradient on the data: loss {loss.item():.4g}, grad norm {norm.item():.4g}"
    return None


def divergence_advice(run):
    """What to do when the loss went non-finite, from the checkpoints in out_dir and the
    val losses metrics.jsonl holds for their steps: every checkpoint was written before that step,
    but its weights may already be diverging. A checkpoint whose val loss is above the untrained
    model's (step 0's) is taken as diverged, and so is one training cannot go on from
    (why_not_resumable, checked for the one named only); of the others, the newest with the lower
    val loss is the one to resume from, at a tenth of the learning rate (at most the default 1e-3).
    The newest two only: those --init_from=resume and resume_previous reach. Rank 0 checks and
    advises; the other ranks point to its line."""
    cfg = run.cfg
    if not run.master:
        return "Rank 0's line says what to do."
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    records = read_metrics(path)[0] if os.path.isfile(path) else []
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    files = [(checkpoint_step(p), p) for p in checkpoint_files(cfg.out_dir) if written(p)]
    files = files[:2]   # --init_from=resume and resume_previous reach these two
    new_lr = min(cfg.learning_rate / 10, 1e-3)
    lr = f"--learning_rate={new_lr:g}" + (f" --min_lr={new_lr / 10:g}" if new_lr < cfg.min_lr else "")
    if not files:
        return f"No checkpoint was written before it: start again with a lower learning rate, e.g. {lr}"
    untrained = val.get(0, float("inf"))
    seen = ", ".join(f"{p} (step {s}, val loss {val.get(s, float('nan')):.4g})" for s, p in files)
    good = sorted((val.get(s, float("inf")), -s, p) for s, p in files if val.get(s, float("inf")) < untrained)
    if not good:
        return (f"The checkpoints, {seen}, score worse than the untrained model (val loss {untrained:.4g}): "
                f"they hold diverged weights; start again in another --out_dir with a lower learning rate, "
                f"e.g. {lr}")
    broken = []
    for _, _, best in good:
        why = why_not_resumable(best, run.data["train"])
        if why is None:
            how = "--init_from=resume" if best == files[0][1] else "--init_from=resume_previous"
            return (f"The newest checkpoints: {seen}. Continue from {best}, the lower val loss, with a lower "
                    f"learning rate: {how} {lr}")
        broken.append(f"{best} ({why})")
    return (f"The newest checkpoints: {seen}; training cannot go on from {' or '.join(broken)}: start again "
            f"in another --out_dir with a lower learning rate, e.g. {lr}")


def perplexity(loss):
    """exp(mean loss), the yardstick's number; inf where it overflows (a diverged model)."""
    return math.exp(loss) if loss < 700 else math.inf


def fmt_bytes(n):
    return f"{n / 2**20:.1f}MiB" if n < 2**30 else f"{n / 2**30:.2f}GiB"


def fmt_count(n):
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def describe(run, model):
    """The resolved config, once, and the planner's model-state bytes and step peak of each stage;
    on a dry run, the model as built too (the first stage's, or the checkpoint's)."""
    cfg, device = run.cfg, run.device
    peak = peak_flops(device)
    off = ("" if run.compiled or not cfg.compile else " (off on MPS)" if device.type == "mps"
           else " (off on CPU: --compile_cpu=True)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    bf16 = " (bf16 autocast, fp32 master weights)" if run.dtype == "bfloat16" else ""
    if cfg.dtype == "auto" and device.type == "cpu":   # why, where it depends on the CPU
        native = runtime.native_bf16()
        bf16 += (f" (dtype=auto: this CPU computes bf16 natively, {native})" if native else
                 " (dtype=auto: this CPU has no native bf16, AVX-512 BF16 or AMX; --dtype=bfloat16 "
                 "forces it)")
    triton = kernels.use_triton(torch.empty(0, device=device))
    data = run.data
    facts = [("device", f"{device} ({name})"), ("dtype", run.dtype + bf16),
             ("compile", f"{run.compiled}{off}"),
             ("kernels", ("triton" if triton else "pytorch reference")
              + f" (STEP_KERNELS={os.environ.get('STEP_KERNELS', 'auto')})"),
             ("world size", run.world), ("tokens/iter", f"{run.tokens_per_iter:,}"),
             ("data", f"{cfg.data_dir}: {data['train'].size:,} train / {data['val'].size:,} val tokens, "
                      f"vocab {run.meta['vocab_size']} (model {run.vocab_size})"),
             ("stages", " + ".join(map(str, run.stage_layers)) + f" layers, iters {run.stage_iters}"),
             ("peak FLOP/s", f"{peak:.3g}" if peak else "n/a (MFU not shown)")]
    keys = asdict(cfg)
    if not cfg.vocab_size:   # 0: the data's vocabulary, padded
        keys["vocab_size"] = (f"{run.vocab_size} (vocab_size=0: the data's {run.meta['vocab_size']}, "
                              f"padded to a multiple of 64)")
    run.log.print("\n".join(f"{k:>28} : {v}" for k, v in facts + list(keys.items())))
    run.log.config({**asdict(cfg), "resolved": dict(facts)})
    final = grow.model_config(cfg, run.depth[-1], run.vocab_size)
    opt = memory.planned_optimizer(cfg)
    plan = grow.stage_memory(final, run.stage_layers, memory.state_bytes,
                             train_embeddings=cfg.train_embeddings, optimizer=opt)
    peaks = planned_peaks(run)
    galore = ", which GaLore's projection lowers" if cfg.optimizer == "galore" else ""
    shared = "FSDP" if cfg.fsdp else "ZeRO-1" if cfg.zero1 else None
    per_rank = f" per rank ({shared} on {run.world} ranks)" if shared and run.world > 1 else ""
    run.log.print(f"planned (int8 accounting, {opt} state{galore}): model state "
                  + ", ".join(f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(plan))
                  + f"; step peak{per_rank} with {run.dtype} activations "
                  + ", ".join(f"stage {i + 1} {fmt_bytes(b)}" for i, b in enumerate(peaks)))
    if cfg.dry_run:
        run.log.print(model)
    if device.type == "cuda":   # against what the GPU had free before the model was placed: what is
        # free now, and what this process's allocator holds (the model, or its shards)
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
        warning = memory_warning(max(peaks), free, device)
        if warning:
            run.log.print(warning)


def planned_peaks(run):
    """The planned step peak of each stage of `run` as configured: per rank under FSDP and ZeRO-1."""
    final = grow.model_config(run.cfg, run.depth[-1], run.vocab_size)
    return memory.configured_peaks(run.cfg, final, run.stage_layers, run.dtype, world=run.world)


# the keys that lower a step's peak memory, as the lines that name them say it
LOWER_PEAK = ("lower batch_size (raising gradient_accumulation_steps keeps the tokens per step), or set "
              "activation_checkpointing=True, loss_chunk=block_size, optimizer=adamw8bit; python plan.py "
              "CONFIG shows what each saves")


def memory_warning(planned, free, device):
    """A line when the planned step peak is over the device's free memory, naming what to change."""
    if planned <= free:
        return None
    return (f"warning: the planned step peak, {fmt_bytes(planned)}, is over the {fmt_bytes(free)} free on "
            f"{device} before the model was placed: {LOWER_PEAK}")


class OutOfMemory:
    """Out of memory in the loop it wraps (a training step, an eval, a stage change: CUDA's
    torch.OutOfMemoryError, the CPU allocator's RuntimeError, a MemoryError) ends the run in one
    line instead of a traceback (out_of_memory_line). The loop sets `step` as it goes."""

    def __init__(self, run):
        self.run, self.step = run, 0

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        cause = error
        while cause is not None and not is_out_of_memory(cause):   # torch.compile wraps what it ran
            cause = cause.__cause__
        if cause is not None:
            raise UserError(out_of_memory_line(self.run, self.step, cause)) from None


def is_out_of_memory(error):
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and re.search(r"CPUAllocator: (can't allocate|not enough) memory|"
                                                      r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED",
                                                      str(error)) is not None)


def ram_available():
    """Bytes of RAM available now, from Linux's /proc/meminfo; None elsewhere (macOS and Windows have
    neither the file nor os.sysconf's SC_AVPHYS_PAGES)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def device_memory(device):
    """What `device` has, in words: a GPU's total and free memory; the CPU's available RAM, and the
    address-space limit (ulimit -v, RLIMIT_AS) where one is set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return f"the {fmt_bytes(total)} of {device} ({fmt_bytes(free)} free now)"
    available = ram_available()
    have = f"the {fmt_bytes(available)} of RAM available" if available is not None else "the machine's RAM"
    try:
        import resource   # Unix only
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            have += f" and the address-space limit of {fmt_bytes(limit)} (ulimit -v)"
    except ImportError:
        pass
    return have


def out_of_memory_line(run, step, error):
    """The step and stage, what the allocation that failed asked for (parsed from the message where
    it says), the stage's planned step peak against what the device has, the keys that lower it, and
    the newest checkpoint to resume from."""
    cfg = run.cfg
    stage = run.stage_of(step)
    planned = planned_peaks(run)[stage]
    # the CPU allocator says "tried to allocate N bytes", CUDA and numpy "allocate 2.00 GiB"
    size = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGTP]?i?B)", str(error))
    asked = fmt_bytes(int(size[1])) if size and size[1] else size[2] if size else "an amount it does not say"
    files = [p for p in checkpoint_files(cfg.out_dir) if written(p)]
    then = (f"then continue from {files[0]} with --init_from=resume" if files else
            "then start again (no checkpoint was written yet)")
    return (f"out of memory at step {step} (stage {stage + 1}/{len(run.depth)}) on {run.device}: it tried to "
            f"allocate {asked}; the planned step peak of stage {stage + 1} is {fmt_bytes(planned)}, against "
            f"{device_memory(run.device)}: {LOWER_PEAK}; {then}")


def merge_record(sums):
    """The metrics.jsonl fields of a merge's sums (model.last_merge)."""
    kept, error = merge_quality(sums)
    return {"merge_kept": kept, "merge_error": error}


def merge_line(sums):
    """The log's phrase for a merge's sums (model.last_merge)."""
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
    """The log line: loss, step time, and tokens/s, MFU and ETA from the average step time of the
    intervals of training alone (an exponential moving average). Warm-up is left out: the first
    interval of a run or of a resume (torch.compile's compilation, the first eval, the kernels'
    measurement) and one that crosses a stage boundary (the growth, a recompilation and a new
    measurement, for a model whose step takes another time: the average starts again after it).
    Until an interval of training alone has ended, the line shows its own interval's rate and no MFU."""

    def __init__(self, run, it):
        self.run, self.peak = run, peak_flops(run.device)
        self.t_start = self.t_last = time.time()
        self.it_last, self.stage = it, None   # no stage yet: the first interval is warm-up
        self.ema_dt = None

    def log(self, it, stage, model, loss, norm, lr):
        run = self.run
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        now = time.time()
        dt = (now - self.t_last) / (it - self.it_last)   # a resume's first interval may be short
        warm = stage == self.stage
        if not warm:
            self.ema_dt = None
        elif self.ema_dt is None:
            self.ema_dt = dt
        else:
            self.ema_dt = 0.9 * self.ema_dt + 0.1 * dt
        self.t_last, self.it_last, self.stage = now, it, stage
        step_s = self.ema_dt or dt
        tok_s = run.tokens_per_iter / step_s
        mfu = None
        if self.peak and self.ema_dt:   # the model's FLOPs per token change at each growth
            mfu = 100 * model.estimate_flops() * tok_s / (self.peak * run.world)
        tr, fr = model.num_params()
        plan = memory.state_bytes(model.config, train_embeddings=model.config.train_embeddings,
                                  optimizer=memory.planned_optimizer(run.cfg))
        cuda_peak = kernels.training_peak(run.device) if run.device.type == "cuda" else None
        loss_v = loss.item()
        mfu_s = f"{mfu:5.1f}%" if mfu is not None else "  n/a"
        cuda_s = f" | cuda peak {fmt_bytes(cuda_peak)}" if cuda_peak is not None else ""
        eta = (run.total_iters - it) * step_s / 60
        run.log.print(f"step {it:>6}/{run.total_iters} | stage {stage + 1}/{len(run.depth)} | loss "
                      f"{loss_v:.4f} | lr {lr:.2e} | norm {norm.item():6.3f} | {1000 * dt:7.1f}ms | "
                      f"{tok_s:9,.0f} tok/s | mfu {mfu_s} | train {fmt_count(tr)} frozen {fmt_count(fr)} | "
                      f"model state {fmt_bytes(plan)} (planned){cuda_s} | eta {eta:.1f}m")
        run.log.record(step=it, stage=stage + 1, loss=loss_v, lr=lr, grad_norm=norm.item(),
                       ms_per_step=1000 * dt, tokens_per_s=tok_s, mfu=mfu, trainable=tr, frozen=fr,
                       plan_bytes=plan, cuda_max_allocated=cuda_peak)

    def done(self, best_val):
        """The run's last line: its tokens, wall time, best val loss and, on CUDA, training's peak."""
        run = self.run
        cuda = run.device.type == "cuda"
        peak = f", peak cuda {fmt_bytes(kernels.training_peak(run.device))}" if cuda else ""
        run.log.print(f"done: {run.total_iters} iters, {run.total_iters * run.tokens_per_iter:,} tokens in "
                      f"{(time.time() - self.t_start) / 60:.1f} min, best val {best_val:.4f}{peak}")
