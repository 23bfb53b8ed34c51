"""Checkpoints: the file format, what a run saves and takes back, and the checks before a resume.

A run keeps its newest keep_checkpoints files, out_dir/ckpt-<iteration>.pt. Each file is a short
header (a magic line and the BLAKE2b digest of the payload), then the torch.save payload. It is
written to a temp file, flushed to disk and renamed, so a crash or kill at any moment leaves the
older files whole; the digest catches a file damaged later (a bad disk, a partial copy). A run's
checkpoint holds the model and its config, the optimizer, the iteration, the RNG states and the
kernels' choices, so that a resume continues exactly; it resumes only under the config it was
trained with (check_resume).
"""
import hashlib
import os
import random
import shutil
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist

from model import GPTConfig
from stepgpt import kernels, optim, sharding
from stepgpt.errors import UserError

# keys a run may change when it resumes without changing what it computes
RUNTIME_KEYS = {"init_from", "eval_only", "dry_run", "device", "compile", "compile_cpu", "log_interval",
                "sample_tokens", "out_dir", "stop_at", "keep_checkpoints", "zero1", "fsdp",
                "sync_check_every", "activation_checkpointing", "loss_chunk", "tensorboard_dir", "wandb_log",
                "wandb_project", "wandb_run_name"}
# keys that fix the model and its stages: a checkpoint resumes only under the same values
STAGE_KEYS = {"data_dir", "stage_layers", "target_layers", "n_stages", "grow_init", "grow_where"}
# what a prepared folder's meta.json says of its data that a resume needs unchanged
DATA_KEYS = ("train_tokens", "val_tokens", "tokenizer", "vocab_ranks", "vocab_size", "source")

MAGIC = b"step-gpt checkpoint v1\n"
DIGEST_HEX = 64


class _HashingWriter:
    """A file wrapper that hashes what torch.save writes through it, and keeps the OSError a write
    raised (torch.save turns it into a RuntimeError that no longer says "disk full")."""

    def __init__(self, f):
        self.f, self.hash, self.error = f, hashlib.blake2b(digest_size=DIGEST_HEX // 2), None

    def write(self, b):
        self.hash.update(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def checkpoint_path(out_dir, it):
    return os.path.join(out_dir, f"ckpt-{it:08d}.pt")


def checkpoint_files(out_dir):
    """The checkpoints of a run folder, newest (highest iteration) first: every entry named like
    one, so that something else under such a name (a directory) is reported, never passed over."""
    if not os.path.isdir(out_dir):
        return []
    names = [n for n in os.listdir(out_dir)
             if n.startswith("ckpt-") and n.endswith(".pt") and n[5:-3].isdigit()]
    return [os.path.join(out_dir, n) for n in sorted(names, reverse=True)]


def remove_temp_files(out_dir):
    """The temp files of saves that a kill interrupted (call it holding out_dir's lock: they are
    ours then)."""
    for name in os.listdir(out_dir):
        if name.endswith(".pt.tmp") and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def _tensor_bytes(obj):
    """Bytes of the tensors in a nested state (about what torch.save writes)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(_tensor_bytes(x) for x in items)


def _size(n):
    return f"{n / 2**20:,.1f} MiB"


def new_file(path):
    """A script's --out (an argparse type): a path where nothing is yet, in a folder that exists.
    Nothing a user already has is replaced unasked."""
    folder = os.path.dirname(path) or "."
    if os.path.lexists(path):
        raise UserError(f"--out {path} exists: choose another --out or delete {path}")
    if not os.path.isdir(folder):
        raise UserError(f"--out {path}: there is no folder {folder}; create it or choose another --out")
    return path


def save_checkpoint(path, state, keep=0):
    """Write `state` to `path` atomically with its digest; then, with keep > 0, delete all but the
    newest `keep` checkpoint files of the folder. A full disk (or a file size limit) is one line
    that names the bytes needed, with the temp file removed and the older files as they were."""
    folder, tmp, writer = os.path.dirname(path) or ".", path + ".tmp", None
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + b"0" * DIGEST_HEX + b"\n")
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.seek(len(MAGIC))
            f.write(writer.hash.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        error = e if isinstance(e, OSError) else writer.error if writer else None
        if error is None:   # a RuntimeError that is not a failed write: a bug, shown as it is
            raise
        if os.path.isfile(tmp):
            os.remove(tmp)
        fallback = "no earlier checkpoint exists: free space, then start again"
        older = [p for p in checkpoint_files(folder) if p != path and os.path.isfile(p)]
        if older:
            why = verify_checkpoint(older[0])
            fallback = f"the previous one, {older[0]}, is unusable ({why})"
            if why is None:
                fallback = f"the previous one, {older[0]}, is intact (checksum verified): free space, then " \
                           f"--init_from=resume"
        need, free = _size(_tensor_bytes(state)), _size(shutil.disk_usage(folder).free)
        raise UserError(f"could not write checkpoint {path} ({error.strerror or error}): it needs about "
                        f"{need}, {free} are free there; {fallback}") from None
    dir_fd = os.open(folder, os.O_RDONLY)
    try:   # the rename itself must reach the disk before older files are deleted
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep:
        for old in [p for p in checkpoint_files(folder) if os.path.isfile(p)][keep:]:
            os.remove(old)


def verify_checkpoint(path):
    """-> None if the file is whole, else why not (one phrase)."""
    if not os.path.isfile(path):
        return "not a file"
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + DIGEST_HEX + 1)
            if not head.startswith(MAGIC):
                return "not a checkpoint of this project (no step-gpt header)"
            h = hashlib.blake2b(digest_size=DIGEST_HEX // 2)
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if h.hexdigest().encode() != head[len(MAGIC):-1]:
        return "checksum mismatch: the file is truncated or damaged"
    return None


def load_checkpoint(path, rank0_only=False):
    """A checkpoint file, verified; or the newest one of a run folder. rank0_only (FSDP): see
    _read_on_rank0."""
    if rank0_only and dist.is_initialized():
        return _read_on_rank0(lambda: load_checkpoint(path))
    if os.path.isdir(path) and not path.endswith(".pt"):
        files = checkpoint_files(path)
        if not files:
            raise UserError(f"no checkpoint in {path}; train first, or use init_from=scratch")
        why = verify_checkpoint(files[0])
        if why and len(files) > 1:
            raise UserError(f"the newest checkpoint of {path}, {files[0]}, is unusable ({why}); the one "
                            f"before it is {files[1]}: pass that file, or remove the unusable one")
        path = files[0]
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    why = verify_checkpoint(path)
    if why:
        raise UserError(f"checkpoint {path} is unusable ({why})")
    with open(path, "rb") as f:
        f.seek(len(MAGIC) + DIGEST_HEX + 1)
        ckpt = torch.load(f, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    return ckpt


def resume_checkpoint(out_dir, rank0_only=False):
    """The checkpoint a resumed run continues from: the newest of out_dir (claim() has moved aside
    the one after it for --init_from=resume_previous). A damaged newest file is an error that names
    the fallback, never a silent switch to it. -> (path, checkpoint). rank0_only (FSDP): see
    _read_on_rank0."""
    if rank0_only and dist.is_initialized():
        return _read_on_rank0(lambda: resume_checkpoint(out_dir))
    files = checkpoint_files(out_dir)
    if not files:
        raise UserError(f"no checkpoint in {out_dir} to resume from; train first, or use init_from=scratch")
    why = verify_checkpoint(files[0])
    if why:
        hint = "no earlier checkpoint is left: start again in another --out_dir"
        if len(files) > 1:
            hint = f"resume from the one before it, {files[1]}, with --init_from=resume_previous"
        raise UserError(f"checkpoint {files[0]} is unusable ({why}); {hint}")
    return files[0], load_checkpoint(files[0])


def _read_on_rank0(read):
    """read() (load_checkpoint or resume_checkpoint) on rank 0 alone: the other ranks get its result
    with the model's and the optimizer's state as None (FSDP sends each rank its rows of them from
    rank 0: stepgpt/sharding.py), or rank 0's error, so that no rank holds a whole checkpoint but
    rank 0."""
    result, got = None, [None, None]
    if dist.get_rank() == 0:
        try:
            result = read()
        except UserError as e:
            got[1] = e
        else:
            path, ckpt = result if isinstance(result, tuple) else (None, result)
            small = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}
            got[0] = (path, {**small, "model": None, "optimizer": None}, isinstance(result, tuple))
    dist.broadcast_object_list(got, src=0)
    if got[1] is not None:
        raise got[1]
    if result is not None:
        return result
    path, ckpt, pair = got[0]
    return (path, ckpt) if pair else ckpt


def tensor_digest(state):
    """A BLAKE2b digest of a state dict's tensors (names, dtypes, shapes and bytes): equal digests,
    bit-identical tensors."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# a run's checkpoints

def claim(out_dir, init_from):
    """A run owns the checkpoints of its out_dir: a fresh run into a folder that holds another run's
    would lose its own to their rotation (it keeps the highest steps) and leave --init_from=resume
    to pick up theirs. So a fresh run there stops before any work; a resume continues them, and
    --init_from=resume_previous moves the newest aside (to NAME.superseded, kept), so that the run
    continuing from the one before it owns the folder's newest file. Call it on rank 0 holding
    out_dir's lock, before the other ranks look (the temp files of an interrupted save are then
    ours to remove)."""
    remove_temp_files(out_dir)
    files = checkpoint_files(out_dir)
    if files and init_from not in ("resume", "resume_previous"):
        raise UserError(f"out_dir={out_dir!r} holds the checkpoints of an earlier run (newest {files[0]}): "
                        f"continue it with --init_from=resume, or start this run in another --out_dir (or "
                        f"delete them)")
    if init_from == "resume_previous":
        if len(files) < 2:
            raise UserError(f"no earlier checkpoint in {out_dir} to resume from (it holds {len(files)}); use "
                            f"--init_from=resume")
        why = verify_checkpoint(files[1])
        if why:
            raise UserError(f"the checkpoint before the newest, {files[1]}, is unusable ({why}) and no "
                            f"earlier one is kept: start again in another --out_dir")
        os.replace(files[0], files[0] + ".superseded")
        print(f"moved {files[0]} aside to {files[0]}.superseded: the run continues from {files[1]}",
              flush=True)


def save(run, model, opt, it, best_val, evaluated):
    """Every rank calls it (ZeRO-1 gathers the optimizer state, FSDP the model's and the optimizer's
    shards, whole, to rank 0's CPU: one format for 1 process, DDP and FSDP); rank 0 writes
    out_dir/ckpt-<it>.pt. `evaluated`: the checkpoint holds step `it`'s stage work and eval (written
    at the eval), or is the state after step it-1 (written on a signal), which a resume then
    evaluates first."""
    if sharding.sharded(model):
        weights, optimizer = sharding.full_state(model), sharding.full_optimizer_state(opt)
    else:
        weights, optimizer = model.state_dict(), optim.state_dict(opt)
    if run.master:
        save_checkpoint(checkpoint_path(run.cfg.out_dir, it), {
            "model": weights, "model_args": asdict(model.config), "optimizer": optimizer,
            "iter_num": it, "best_val_loss": best_val, "evaluated": evaluated, "config": asdict(run.cfg),
            "meta": run.meta, "kernels": kernels.state(), "wandb_id": run.log.wandb_id,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None}},
            keep=run.cfg.keep_checkpoints)
    if run.world > 1:
        dist.barrier()   # a save that failed on rank 0 must not leave the others training on


def check_resume(path, ckpt, cfg, meta, total_iters):
    """A checkpoint resumes only under the config it was trained with: the model's keys, the stages
    and the data must match (the data's token counts too: a folder prepared again from another text
    is another data set), the optimizer too (its state's layout differs), and the schedule must not
    end before it; other changes warn. -> the keys that changed (the run will not replay exactly)."""
    theirs = dict(ckpt["config"])
    theirs["data_dir"] = os.path.normpath(theirs.get("data_dir", ""))   # "data/x/" is "data/x"
    ours = {**asdict(cfg), "data_dir": os.path.normpath(cfg.data_dir)}
    fixed = {f.name for f in fields(GPTConfig)} | STAGE_KEYS
    diff = [f"{k}={theirs.get(k)!r} (config says {v!r})" for k, v in ours.items()
            if k in fixed - RUNTIME_KEYS and theirs.get(k) != v]
    if diff:
        raise UserError(f"checkpoint {path} is of a different model: {', '.join(diff[:3])}; resume with the "
                        f"config it was trained with, or use a new out_dir")
    written_by = theirs.get("optimizer", "adamw")
    if written_by != cfg.optimizer:
        raise UserError(f"checkpoint {path} holds optimizer={written_by!r} state, the config says "
                        f"{cfg.optimizer!r}: resume with --optimizer={written_by}, or start from its weights "
                        f"with --init_from={path}")
    was = ckpt.get("meta") or {}
    changed = [k for k in DATA_KEYS if k in was and was[k] != meta.get(k)]
    if changed:
        then_now = ", ".join(f"{k} {was[k]!r} then, {meta.get(k)!r} now" for k in changed[:2])
        raise UserError(f"{cfg.data_dir} holds other data than checkpoint {path} was trained on "
                        f"({then_now}): prepare it as it was, or start from the checkpoint's weights with "
                        f"--init_from={path} and a new --out_dir")
    it = ckpt["iter_num"]
    if it > total_iters:
        raise UserError(f"checkpoint {path} is at step {it}, past the end of this run's schedule "
                        f"({total_iters} steps: batch_size, gradient_accumulation_steps, max_iters or "
                        f"stage_tokens changed?); resume with the schedule it was trained with")
    if 0 < cfg.stop_at < it:
        raise UserError(f"stop_at={cfg.stop_at} is before checkpoint {path}'s step {it}: give a later "
                        f"step, or 0 to train to the end")
    return [k for k, v in ours.items() if k not in RUNTIME_KEYS and theirs.get(k) != v]


def restore(ckpt, device, model, opt):
    """What a resumed run takes back besides the model: the optimizer state (under FSDP each rank
    keeps its rows of it), the RNG states, and the kernels' measured paths and tuned configs (so it
    computes the same way)."""
    if sharding.sharded(model):
        sharding.load_optimizer(opt, ckpt["optimizer"])
    else:
        opt.load_state_dict(ckpt["optimizer"])
    kernels.load_state(ckpt.get("kernels", {}))
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    np.random.set_state(ckpt["rng"]["numpy"])
    random.setstate(ckpt["rng"]["python"])
