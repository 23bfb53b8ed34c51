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
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist

from model import GPTConfig
from stepgpt import kernels, optim
from stepgpt.errors import UserError

# keys a run may change when it resumes without changing what it computes
RUNTIME_KEYS = {"init_from", "eval_only", "dry_run", "device", "compile", "compile_cpu", "log_interval",
                "sample_tokens", "out_dir", "stop_at", "keep_checkpoints", "zero1", "sync_check_every",
                "activation_checkpointing", "loss_chunk", "tensorboard_dir", "wandb_log", "wandb_project",
                "wandb_run_name"}
# keys that fix the model and its stages: a checkpoint resumes only under the same values
STAGE_KEYS = {"data_dir", "stage_layers", "target_layers", "n_stages", "grow_init", "grow_where"}

MAGIC = b"step-gpt checkpoint v1\n"
DIGEST_HEX = 64


class _HashingWriter:
    """A file wrapper that hashes what torch.save writes through it."""

    def __init__(self, f):
        self.f, self.hash = f, hashlib.blake2b(digest_size=DIGEST_HEX // 2)

    def write(self, b):
        self.hash.update(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def checkpoint_path(out_dir, it):
    return os.path.join(out_dir, f"ckpt-{it:08d}.pt")


def checkpoint_files(out_dir):
    """The checkpoints of a run folder, newest (highest iteration) first."""
    if not os.path.isdir(out_dir):
        return []
    names = [n for n in os.listdir(out_dir)
             if n.startswith("ckpt-") and n.endswith(".pt") and n[5:-3].isdigit()]
    return [os.path.join(out_dir, n) for n in sorted(names, reverse=True)]


def save_checkpoint(path, state, keep=0):
    """Write `state` to `path` atomically with its digest; then, with keep > 0, delete all but the
    newest `keep` checkpoints of the folder. A full disk leaves the older files as they were."""
    tmp = path + ".tmp"
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
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        older = [p for p in checkpoint_files(os.path.dirname(path) or ".") if p != path]
        fallback = "no earlier checkpoint exists"
        if older:
            fallback = f"{older[0]} is intact: free space, then resume"
        raise UserError(f"could not write checkpoint {path} ({e.strerror or e}); {fallback}") from None
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:   # the rename itself must reach the disk before older files are deleted
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep:
        for old in checkpoint_files(os.path.dirname(path) or ".")[keep:]:
            os.remove(old)


def verify_checkpoint(path):
    """-> None if the file is whole, else why not (one phrase)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + DIGEST_HEX + 1)
        if not head.startswith(MAGIC):
            return "not a checkpoint of this project (no step-gpt header)"
        h = hashlib.blake2b(digest_size=DIGEST_HEX // 2)
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    if h.hexdigest().encode() != head[len(MAGIC):-1]:
        return "checksum mismatch: the file is truncated or damaged"
    return None


def load_checkpoint(path):
    """A checkpoint file, verified; or the newest one of a run folder."""
    if os.path.isdir(path):
        files = checkpoint_files(path)
        if not files:
            raise UserError(f"no checkpoint in {path}; train first, or use init_from=scratch")
        path = files[0]
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    why = verify_checkpoint(path)
    if why:
        raise UserError(f"checkpoint {path} is unusable: {why}")
    with open(path, "rb") as f:
        f.seek(len(MAGIC) + DIGEST_HEX + 1)
        ckpt = torch.load(f, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    return ckpt


def resume_checkpoint(out_dir, previous=False):
    """The checkpoint a resumed run continues from: the newest of out_dir, or with `previous` the
    one before it. A damaged newest file is an error that names the fallback, never a silent
    switch to it. -> (path, checkpoint)."""
    files = checkpoint_files(out_dir)
    if len(files) < 1 + previous:
        raise UserError(f"no {'earlier ' if previous else ''}checkpoint in {out_dir} to resume from; "
                        f"train first, or use init_from=scratch")
    path = files[int(previous)]
    why = verify_checkpoint(path)
    if why:
        hint = "no earlier checkpoint is left: start with init_from=scratch"
        if not previous and len(files) > 1:
            hint = f"resume from the one before it, {files[1]}, with --init_from=resume_previous"
        raise UserError(f"checkpoint {path} is unusable ({why}); {hint}")
    return path, load_checkpoint(path)


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

def save(run, model, opt, it, best_val):
    """Every rank calls it (ZeRO-1 gathers the optimizer state); rank 0 writes out_dir/ckpt-<it>.pt."""
    optimizer = optim.state_dict(opt)
    if run.master:
        save_checkpoint(checkpoint_path(run.cfg.out_dir, it), {
            "model": model.state_dict(), "model_args": asdict(model.config), "optimizer": optimizer,
            "iter_num": it, "best_val_loss": best_val, "config": asdict(run.cfg), "meta": run.meta,
            "kernels": kernels.state(), "wandb_id": run.log.wandb_id,
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
