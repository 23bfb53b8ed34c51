"""Pre-train a GPT, vanilla or with STEP's stages, on one CPU, one GPU or many (torchrun).

  python train.py config/step_small.py                      # the default STEP run
  python train.py config/vanilla_small.py --batch_size=32   # a config file, then overrides
  torchrun --standalone --nproc_per_node=8 train.py config/step_350m.py

A run is a list of stages. Stage 1 trains a small model; at each later stage the model grows by
n_i layers, the layers trained so far are frozen in int8 behind LoRA adapters, and the optimizer is
rebuilt over what is still trainable (grow.py). Vanilla training is the same loop with one stage.

Read train() first: setup, build, then the loop (stage boundary, eval and checkpoint, train step,
log); enter_stage is all that happens at a stage boundary. Every key and its default: GPTConfig
(model.py) and TrainConfig (stepgpt/config.py). The machinery: checkpoints and resume
(stepgpt/checkpoint.py), the lock, signals and replica checks (stepgpt/runtime.py), the log line
and metrics (stepgpt/monitor.py).
"""
import hashlib
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import frozen_linear
import grow
from data.load import eval_batches, load_data, model_vocab, sample_batch, tokenizer_of
from model import GPT
from sample import sample_text
from stepgpt import checkpoint, kernels, monitor, optim, runtime, sharding
from stepgpt.config import load_config
from stepgpt.errors import UserError, run_cli
from stepgpt.hf import load_hf
from stepgpt.lock import FolderLock

# ----------------------------------------------------------------------------------------------
# data


def get_batch(run, split, seed, index):
    """A batch that is a pure function of `seed` and `index`: resuming needs no data-loader state
    (data/load.py: windows at random offsets of a token stream, or rows of documents, shuffled)."""
    x, y = sample_batch(run.data, split, run.cfg.batch_size, run.cfg.block_size, seed, index)
    if run.device.type == "cuda":
        return tuple(t.pin_memory().to(run.device, non_blocking=True) for t in (x, y))
    return x.to(run.device), y.to(run.device)   # MPS; on the CPU they are there


def batch_seed(seed, split, it, micro):
    # one reproducible stream per (split, iteration, global micro-step): the same config trains on
    # the same batches on 1 process or N ranks (rank r takes micro-steps r*A .. r*A+A-1). Not
    # hash(), which Python salts per process for strings.
    key = f"{seed}/{split}/{it}/{micro}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------------------------
# optimisation

def configure_optimizer(model, cfg, device, previous=None, carried=()):
    """AdamW (or cfg.optimizer's) over the trainable set: weight decay on matrices, lora_weight_decay on
    the adapters (0 by default, as LoRA and ReLoRA), none on norms. At a new stage, the `carried` parameters
    keep the state they had in `previous`, the last stage's optimizer."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if p.dim() >= 2 and "lora_" not in n],
               "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if "lora_" in n], "weight_decay": cfg.lora_weight_decay},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    if cfg.optimizer == "adamw" and not cfg.zero1:
        opt = torch.optim.AdamW(groups, fused=device.type == "cuda", **kw)
        opt.state.update({p: previous.state[p] for p in carried if p in previous.state})
    else:   # Muon, 8-bit AdamW, GaLore, ZeRO-1 (stepgpt/optim.py), carrying `carried`'s state over too
        opt = optim.build(model, groups, cfg, device, previous, carried, **kw)
    return opt


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


# ----------------------------------------------------------------------------------------------
# the run

@dataclass
class Run:
    """What stays fixed for a whole run: the config, the machine, the data and the stage plan."""
    cfg: object
    device: torch.device
    rank: int
    world: int
    dtype: str                  # float32 or bfloat16 (autocast, fp32 master weights)
    autocast: object            # the forward passes' autocast context
    compiled: bool              # torch.compile
    data: dict
    meta: dict
    vocab_size: int             # the model's: the data's, padded to a multiple of 64
    tokens_per_iter: int
    stage_layers: list          # layers added per stage
    stage_iters: list
    depth: list                 # model depth in each stage
    restarts: list              # iterations where the learning rate re-warms: stage starts, ReLoRA restarts
    lock: FolderLock
    log: monitor.Logger = None
    resumed_at: int = None      # the step a resume starts at, when its checkpoint holds that step's eval
    init: str = None            # what init_from does here (auto: resume or scratch, as out_dir holds)
    peers: runtime.Peers = None

    master = property(lambda self: self.rank == 0)
    total_iters = property(lambda self: sum(self.stage_iters))
    resuming = property(lambda self: self.init in ("resume", "resume_previous"))

    def stage_of(self, it):
        starts = [sum(self.stage_iters[:i]) for i in range(len(self.stage_iters))]
        return max(i for i, s in enumerate(starts) if s <= min(it, self.total_iters - 1))

    def __enter__(self):
        return self

    def __exit__(self, *exc):   # the log closed, the lock released; under torchrun a rank gone is one line
        runtime.end(self, exc[1])


def setup(cfg):
    """Device and process group, precision, data (the default set is prepared on first use), and
    the stage plan. Rank 0 holds out_dir's lock until the run ends (`with setup(cfg) as run`) and
    decides what init_from does there (checkpoint.claim: auto continues the run the folder holds)."""
    ddp, rank, local, world = runtime.ranks()
    lock = init = None
    if rank == 0 and not cfg.dry_run:   # a dry run reads out_dir and writes nothing there
        lock = FolderLock(cfg.out_dir, "run.lock", f"out_dir={cfg.out_dir!r}", "choose another --out_dir")
    try:
        if rank == 0:
            init = checkpoint.claim(cfg.out_dir, cfg.init_from, dry_run=cfg.dry_run)
        return _setup(cfg, ddp, rank, local, world, lock, init)
    except BaseException:
        if lock:
            lock.release()
        raise


def _setup(cfg, ddp, rank, local, world, lock, init):
    device = torch.device(runtime.pick_device(cfg.device, local, ddp))   # auto: CUDA, then MPS, then the CPU
    dtype, autocast, compiled = runtime.precision(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peers = None
    if ddp:   # every rank does what rank 0 decided; Peers: what the ranks tell each other when one is gone
        init, peers = runtime.start_group(cfg, device, init)

    default_data = os.path.normpath(cfg.data_dir) == os.path.join("data", "shakespeare")
    if default_data and not os.path.isfile(os.path.join(cfg.data_dir, "meta.json")):
        if rank == 0:   # two first runs at once: the second waits for the first's data
            from data.prepare import prepare
            prepare("shakespeare", cfg.data_dir, if_missing=True)
        if world > 1:
            dist.barrier()
    data, meta = load_data(cfg.data_dir, cfg.block_size)
    runtime.check_world(cfg, world, data)   # the micro-steps (and FSDP's evals) divide over the ranks
    if cfg.sample_tokens:
        tokenizer_of(meta, cfg.data_dir)   # the final sample's: a missing one fails now, not at the end
    vocab_size = model_vocab(cfg.vocab_size, meta, cfg.data_dir)
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    stage_layers, stage_iters = grow.stage_plan(cfg, vocab_size, tokens_per_iter)
    starts = [sum(stage_iters[:i]) for i in range(1, len(stage_iters))]
    every = cfg.relora_every
    relora = [s + k for s, n in zip(starts, stage_iters[1:]) for k in range(every, n, every)] if every else []
    depth = [sum(stage_layers[:i + 1]) for i in range(len(stage_layers))]
    return Run(cfg, device, rank, world, dtype, autocast, compiled, data, meta, vocab_size, tokens_per_iter,
               stage_layers, stage_iters, depth, sorted(starts + relora), lock, init=init, peers=peers)


def build(run):
    """The model and optimizer: fresh, resumed (everything, from out_dir's newest checkpoint, or
    the one before it) or from a checkpoint's weights (fresh optimizer and schedule).
    -> (model, optimizer, iteration, best val); model None where out_dir holds the run finished."""
    cfg = run.cfg
    ckpt, it, best_val = None, 0, float("inf")
    first = grow.model_config(cfg, run.stage_layers[0], run.vocab_size)
    if run.init == "scratch":
        checkpoint.announce(run)
        torch.manual_seed(cfg.seed)   # FSDP: built on the meta device, materialised shard by shard
        model = sharding.new_model(run, first) if cfg.fsdp else GPT(first)
    elif cfg.init_from.startswith("hf:"):   # stage 1 from a Hugging Face LLaMA folder (export_hf.py)
        torch.manual_seed(cfg.seed)
        layers_key = "stage_layers[0]" if len(run.stage_layers) > 1 else "n_layer"
        model = load_hf(cfg.init_from[3:], first, layers_key)
        if run.master:
            print(f"starting from {cfg.init_from} ({model.config.n_layer} layers)")
    else:
        if run.resuming:   # refused in one line unless it continues this run; its end: nothing to train
            path, ckpt = checkpoint.resume_checkpoint(cfg.out_dir, sharded=cfg.fsdp)
            if checkpoint.check_resume(run, path, ckpt):
                return None, None, ckpt["iter_num"], ckpt.get("best_val_loss")
        else:   # FSDP: rank 0 reads a file and shards it out; each rank reads its rows of a folder
            path, ckpt = cfg.init_from, checkpoint.load_checkpoint(cfg.init_from, sharded=cfg.fsdp)
        checkpoint.announce(run, path, ckpt)
        model = sharding.from_state(run, ckpt) if cfg.fsdp else GPT.from_checkpoint(ckpt, path)
        if run.resuming:
            it, best_val = ckpt["iter_num"], ckpt.get("best_val_loss", float("inf"))
            # a checkpoint written at an eval holds its step's stage work and eval; one written on a
            # signal holds the step before them
            run.resumed_at = it if ckpt.get("evaluated", True) else None
        else:   # the checkpoint's depth is stage 1's; later stages still add their n_i on top
            run.depth = [d + model.config.n_layer - run.depth[0] for d in run.depth]
    if model.config.vocab_size != run.vocab_size:
        raise UserError(f"model vocab {model.config.vocab_size} does not match the data's {run.vocab_size}")
    model = sharding.shard_plain(run, model) if cfg.fsdp else model.to(run.device)
    opt = configure_optimizer(model, cfg, run.device)
    if run.resuming:
        checkpoint.restore(ckpt, run.device, model, opt)
    run.log = monitor.Logger(cfg, run.master, keep_until=it if run.resuming else -1,
                             wandb_id=ckpt.get("wandb_id") if run.resuming else None)
    return model, opt, it, best_val


def enter_stage(run, raw, opt, stage, it):
    """A stage boundary: STEP's transition (grow.next_stage: merge, grow, freeze), an optimizer over
    the new trainable set that keeps the state of what carries over (grow.carried_parameters), a
    check that every rank made the same transition, and the model wrapped anew (compile, DDP) for
    the new parameter set. -> (the model, optimizer, what the train step calls, what eval calls)."""
    cfg = run.cfg
    n_new = run.depth[stage] - raw.config.n_layer          # 0: the stage only freezes (ReLoRA)
    def transition(model):   # STEP's: merge, grow, freeze
        grow.next_stage(model, n_new, cfg.grow_init, cfg.grow_where, seed=cfg.seed + stage,
                        train_embeddings=cfg.train_embeddings, rounding=cfg.merge_rounding)
    if cfg.fsdp:   # on each rank's own rows, by the same code; the grown model is then sharded anew
        raw = sharding.next_stage(run, raw, opt, transition)
    else:
        transition(raw)
        raw.to(run.device)
    merged, (tr, fr) = raw.last_merge, raw.num_params()
    run.log.print(f"== stage {stage + 1}/{len(run.depth)}: grew {n_new} layers ({cfg.grow_init}, "
                  f"{cfg.grow_where}) to {raw.config.n_layer}; frozen layers "
                  f"{list(raw.config.frozen_layers)}; trainable {monitor.fmt_count(tr)}, frozen "
                  f"{monitor.fmt_count(fr)}"
                  + ("" if merged is None else f"; {monitor.merge_line(merged)}"), mark=it)
    opt = configure_optimizer(raw, cfg, run.device, previous=opt, carried=grow.carried_parameters(raw))
    runtime.check_replicas(run, raw, f"after the growth at step {it}")
    model, evaluator = wrap(run, raw)
    if merged is not None:
        run.log.record(step=it, stage=stage + 1, **monitor.merge_record(merged))
    return raw, opt, model, evaluator


@torch.no_grad()
def estimate_loss(model, run):
    """Mean loss on a fixed set of eval batches, split over ranks and all-reduced. `model` is not
    the DDP wrapper: a rank with no batch (eval_iters < world) runs no forward, which under DDP
    would leave the collectives unmatched."""
    cfg = run.cfg
    model.eval()
    out = {}
    for split in ("train", "val"):
        fixed = split == "val" and cfg.eval_tokens > 0   # the val split's first eval_tokens tokens, in order
        n = (eval_batches(run.data, cfg.eval_tokens, cfg.batch_size, cfg.block_size) if fixed
             else cfg.eval_iters)
        losses = []
        for k in range(run.rank, n, run.world):
            x, y = get_batch(run, split, None if fixed else batch_seed(cfg.seed, "eval" + split, k, 0), k)
            with run.autocast:
                losses.append(model(x, y, loss_chunk=cfg.loss_chunk)[1].float())
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=run.device)
        if run.world > 1:
            dist.all_reduce(total)
        out[split] = total.item() / n
    model.train()
    return out


def train_step(run, model, raw, opt, it):
    """One optimizer step over gradient_accumulation_steps micro-batches. -> (loss, grad norm, lr)."""
    cfg = run.cfg
    lr = get_lr(it, cfg, run.restarts, run.total_iters)
    for group in opt.param_groups:
        group["lr"] = lr
    accum = cfg.gradient_accumulation_steps // run.world
    for micro in range(accum):
        k = run.rank * accum + micro   # this micro-step's place among all ranks'
        x, y = get_batch(run, "train", batch_seed(cfg.seed, "train", it, k), it * run.world * accum + k)
        # DDP all-reduces the gradients in the last micro-step's backward only (no_sync() is a one-shot
        # context: it holds one micro-step's forward and backward); FSDP reduce-scatters every backward
        with model.no_sync() if isinstance(model, DDP) and micro < accum - 1 else nullcontext():
            with run.autocast:   # [1]: the (B, T, V) logits must not outlive the forward
                loss = model(x, y, checkpointing=cfg.activation_checkpointing, loss_chunk=cfg.loss_chunk)[1]
            (loss / accum).backward()
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), clip)
    if not torch.isfinite(loss) or not torch.isfinite(norm):
        raise UserError(f"non-finite loss or gradient at step {it} (loss {loss.item()}, grad norm "
                        f"{norm.item()}); stopped. {monitor.divergence_advice(run)}")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm, lr


def wrap(run, raw):
    """-> (what the train step calls, what eval calls): the model compiled and, under DDP, wrapped
    for the step only (each rank evaluates its share alone). Both must see each new parameter set.
    DDP does not re-broadcast buffers: the frozen int8 weights are identical on every rank by
    construction, and runtime.check_replicas verifies it."""
    if run.cfg.fsdp:   # sharded already; each block measured gathered, compiled alone (stepgpt/sharding.py)
        return sharding.wrap(run, raw)
    # the frozen linears' kernel paths are measured before torch.compile fixes them in its graph
    kernels.measure_layers(raw, run.cfg.batch_size * run.cfg.block_size, getattr(torch, run.dtype),
                           (frozen_linear.forward, frozen_linear.backward))
    model = torch.compile(raw) if run.compiled else raw
    if run.world == 1:
        return model, model
    ids = [run.device.index] if run.device.type == "cuda" else None
    return DDP(model, device_ids=ids, broadcast_buffers=False), model


def train(cfg):
    with setup(cfg) as run:
        raw, opt, it, best_val = build(run)   # `raw`: the plain module (growth, saving, sampling)
        if raw is None:   # out_dir holds this run finished
            return
        monitor.describe(run, raw)
        if cfg.dry_run:
            return
        runtime.check_replicas(run, raw, "at the start")
        model, evaluator = wrap(run, raw)
        if cfg.eval_only:
            losses = estimate_loss(evaluator, run)
            run.log.print(f"eval only | train {losses['train']:.4f} | val {losses['val']:.4f}")
            return

        meter = monitor.Meter(run, it)
        resumed_at = run.resumed_at
        with runtime.StopRequest() as stop, monitor.OutOfMemory(run) as oom:
            while True:
                oom.step = it   # out of memory in the step, its eval or stage change: one line naming it
                stage = run.stage_of(it)
                # the stage boundary: every layer of the earlier stages must be frozen
                if stage > 0 and len(raw.config.frozen_layers) < run.depth[stage - 1]:
                    raw, opt, model, evaluator = enter_stage(run, raw, opt, stage, it)
                elif it in run.restarts and it != resumed_at and raw.config.frozen_layers:
                    optim.relora_restart(raw, opt, cfg, it)
                    run.log.print(f"== ReLoRA restart at step {it}: {monitor.merge_line(raw.last_merge)}; "
                                  f"adapters re-initialised", mark=it)
                    runtime.check_replicas(run, raw, f"after the ReLoRA restart at step {it}")
                    run.log.record(step=it, stage=stage + 1, **monitor.merge_record(raw.last_merge))

                last = it >= run.total_iters or it == cfg.stop_at > 0
                if (it % cfg.eval_interval == 0 or last) and it != resumed_at:
                    losses = estimate_loss(evaluator, run)
                    best_val = min(best_val, losses["val"])
                    ppl = monitor.perplexity(losses["val"])   # recorded before the checkpoint that holds it
                    run.log.record(step=it, stage=stage + 1, train_loss=losses["train"],
                                   val_loss=losses["val"], val_ppl=ppl)
                    if it > 0:
                        checkpoint.save(run, raw, opt, it, best_val, evaluated=True)
                    saved = " | ckpt saved" if it > 0 else ""
                    run.log.print(f"step {it:>6} | eval | train {losses['train']:.4f} | val "
                                  f"{losses['val']:.4f} (ppl {ppl:.2f}, best {best_val:.4f}){saved}")
                if it == cfg.stop_at > 0:
                    run.log.print(f"stopped at step {it} (stop_at); continue with a later --stop_at, or none")
                    return
                if last:
                    break

                loss, norm, lr = train_step(run, model, raw, opt, it)
                it += 1
                if cfg.sync_check_every and it % cfg.sync_check_every == 0:
                    runtime.check_replicas(run, raw, f"after step {it}")
                if it % cfg.log_interval == 0:
                    meter.log(it, stage, raw, loss, norm, lr)
                if stop.requested(run):
                    saved = checkpoint.save(run, raw, opt, it, best_val, evaluated=False)
                    who = stop.signal or "a signal to another rank"
                    run.log.print(f"stopped by {who} after step {it}: saved {saved}; the same command "
                                  f"continues it")
                    return

        meter.done(best_val)
        if cfg.sample_tokens and (run.master or cfg.fsdp):   # FSDP: each forward takes every rank
            # under the run's autocast, as training (FSDP's bf16 policy gathers blocks in bf16), and eager
            # (FSDP's blocks, compiled in place, would recompile for each length the sample grows to)
            with run.autocast, torch.compiler.set_stance("force_eager"):
                text = sample_text(raw, run.meta, prompt="\n", max_new_tokens=cfg.sample_tokens,
                                   temperature=0.8, top_k=200, seed=cfg.seed, data_dir=cfg.data_dir)
            path = os.path.join(cfg.out_dir, "sample.txt")
            if run.master:
                with open(path, "w") as f:
                    f.write(text)
            run.log.print(f"sample written to {path}:\n{text[:300]}")


def main(argv):
    try:
        train(load_config(argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
