"""Checkpoint files and the checks before a run resumes from one.

A run keeps its newest keep_checkpoints files, out_dir/ckpt-<iteration>.pt. Each file is a short
header (a magic line and the BLAKE2b digest of the payload), then the torch.save payload. It is
written to a temp file, flushed to disk and renamed, so a crash or kill at any moment leaves the
older files whole; the digest catches a file damaged later (a bad disk, a partial copy).
"""
import hashlib
import os

import torch

from stepgpt.errors import UserError

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
