"""Checkpoints: the file format, what a run saves and takes back, and the checks before a resume.

A run keeps its newest keep_checkpoints checkpoints in out_dir, each a file ckpt-<iteration>.pt or,
for an FSDP run too large for rank 0 to gather (fsdp_checkpoint), a folder ckpt-<iteration>.dcp. A
file is a short header (a magic line and the BLAKE2b digest of the payload), then the torch.save
payload. A folder holds torch.distributed.checkpoint's files (each rank writes its own rows),
header.pt (everything else) and MANIFEST.json (every file's size and digest). Either is written
under a temp name, flushed to disk and renamed, so a crash or kill at any moment leaves the older
ones whole; the digests catch one damaged later (a bad disk, a partial copy). Both hold the same
dict (load_checkpoint reads a folder whole on one process): the model and its config, the
optimizer, the iteration, the RNG states and the kernels' choices, so that a resume continues
exactly; it resumes only under the config it was trained with (check_resume).
"""
import hashlib
import json
import os
import random
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import MISSING, asdict, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from model import GPTConfig
from stepgpt import kernels, optim, safeload, sharding
from stepgpt.errors import UserError

# keys a run may change when it resumes without changing what it computes
RUNTIME_KEYS = {"init_from", "eval_only", "dry_run", "device", "compile", "compile_cpu", "log_interval",
                "sample_tokens", "out_dir", "stop_at", "keep_checkpoints", "zero1", "fsdp", "fsdp_checkpoint",
                "sync_check_every", "activation_checkpointing", "loss_chunk", "tensorboard_dir", "wandb_log",
                "wandb_project", "wandb_run_name", "dist_timeout"}
# keys that fix the model and its stages: a checkpoint resumes only under the same values
STAGE_KEYS = {"data_dir", "stage_layers", "target_layers", "n_stages", "grow_init", "grow_where"}
# what a prepared folder's meta.json says of its data that a resume needs unchanged
DATA_KEYS = ("train_tokens", "val_tokens", "tokenizer", "vocab_ranks", "vocab_size", "source")

MAGIC = b"step-gpt checkpoint v1\n"
DIGEST_HEX = 64
HEADER, MANIFEST = "header.pt", "MANIFEST.json"   # a .dcp folder's own files
# fsdp_checkpoint="auto": a checkpoint is gathered to rank 0 while it takes at most this share of
# rank 0's RAM (docs/distributed.md says why a quarter)
GATHER_SHARE = 0.25


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


class _KeptErrors(FileSystem):
    """torch.distributed.checkpoint's file system, keeping the OSError a write of its files raised:
    DCP writes a tensor with torch.save, which turns it into a RuntimeError that no longer says
    "disk full" (as _HashingWriter keeps it for a file)."""
    error = None

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _Keeping(stream, self) if "w" in mode else stream


class _Keeping:
    """A stream whose writes keep their OSError in `owner` (everything else is the stream's)."""

    def __init__(self, stream, owner):
        self.stream, self.owner = stream, owner

    def _kept(self, name, *a):
        try:
            return getattr(self.stream, name)(*a)
        except OSError as e:
            self.owner.error = e
            raise

    def write(self, b):
        return self._kept("write", b)

    def flush(self):
        return self._kept("flush")

    def __getattr__(self, name):
        return getattr(self.stream, name)


def checkpoint_path(out_dir, it, sharded=False):
    return os.path.join(out_dir, f"ckpt-{it:08d}{'.dcp' if sharded else '.pt'}")


def checkpoint_step(path):
    return int(os.path.basename(path)[5:].split(".")[0])


def checkpoint_files(out_dir):
    """The checkpoints of a run folder, newest (highest iteration) first: every entry named like
    one (ckpt-<digits>.pt or .dcp), so that something else under such a name (a directory named
    .pt) is reported, never passed over."""
    if not os.path.isdir(out_dir):
        return []
    names = [n for n in os.listdir(out_dir) if n.startswith("ckpt-") and
             os.path.splitext(n)[1] in (".pt", ".dcp") and os.path.splitext(n)[0][5:].isdigit()]
    paths = [os.path.join(out_dir, n) for n in names]
    return sorted(paths, key=lambda p: (checkpoint_step(p), p), reverse=True)


def written(path):
    """Whether `path` is a checkpoint this project wrote (a .pt file; a .dcp folder with its
    manifest), whole or not: one the rotation may delete."""
    if path.endswith(".dcp"):
        return os.path.isfile(os.path.join(path, MANIFEST))
    return os.path.isfile(path)


def remove_temp_files(out_dir):
    """The temp files and folders of saves (or of a rotation's deletes) that a kill interrupted (call it
    holding out_dir's lock: they are ours then). -> their paths."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.endswith(".pt.tmp") and os.path.isfile(path):
            os.remove(path)
        elif name.endswith(".dcp.tmp") and os.path.isdir(path):
            shutil.rmtree(path)
        else:
            continue
        removed.append(path)
    return removed


def _rotate(folder, keep):
    """Delete all but the newest `keep` checkpoints of the folder (a .dcp folder renamed to a temp
    name first, so that a kill while it is deleted leaves nothing under a checkpoint's name)."""
    for old in [p for p in checkpoint_files(folder) if written(p)][keep:]:
        if os.path.isdir(old):
            os.replace(old, old + ".tmp")
            shutil.rmtree(old + ".tmp")
        else:
            os.remove(old)


def _fsync_dir(folder):
    if os.name == "nt":   # Windows cannot open a folder to fsync it: the rename's durability is NTFS's
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    newest `keep` checkpoints of the folder. A full disk (or a file size limit) is one line
    that names the bytes needed, with the temp file removed and the older files as they were."""
    folder, tmp, writer = os.path.dirname(path) or ".", path + ".tmp", []
    try:
        _write_file(tmp, state, writer)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        error = e if isinstance(e, OSError) else writer[0].error if writer else None
        if error is None:   # a RuntimeError that is not a failed write: a bug, shown as it is
            raise
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise _write_failed(path, error, _tensor_bytes(state)) from None
    _fsync_dir(folder)   # the rename itself must reach the disk before older files are deleted
    if keep:
        _rotate(folder, keep)


def _write_file(path, state, writer=None):
    """torch.save of `state` into `path` behind the header (magic line, digest), fsynced. `writer`:
    a list that gets the _HashingWriter (which keeps the OSError a write raised)."""
    with open(path, "wb") as f:
        f.write(MAGIC + b"0" * DIGEST_HEX + b"\n")
        w = _HashingWriter(f)
        if writer is not None:
            writer.append(w)
        torch.save(state, w)
        f.seek(len(MAGIC))
        f.write(w.hash.hexdigest().encode())
        f.flush()
        os.fsync(f.fileno())


def _write_failed(path, error, need):
    """The one line for a checkpoint that could not be written (`error`, an OSError; `need`: bytes),
    naming the one before it and whether it is whole."""
    folder = os.path.dirname(path) or "."
    fallback = "no earlier checkpoint exists: free space, then start again"
    older = [p for p in checkpoint_files(folder) if p != path and written(p)]
    if older:
        why = verify_checkpoint(older[0])
        fallback = f"the previous one, {older[0]}, is unusable ({why})"
        if why is None:
            fallback = f"the previous one, {older[0]}, is intact (checksum verified): free space, then " \
                       f"--init_from=resume"
    free = _size(shutil.disk_usage(folder).free)
    return UserError(f"could not write checkpoint {path} ({error.strerror or error}): it needs about "
                     f"{_size(need)}, {free} are free there; {fallback}")


def _file_digest(path):
    h = hashlib.blake2b(digest_size=DIGEST_HEX // 2)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(path, share=(0, 1)):
    """-> None if the checkpoint is whole, else why not (one phrase). A .dcp folder: every file its
    manifest lists is there at its size; with share=(i, n) only every n-th file from the i-th is
    hashed (the ranks of an FSDP resume hash a share each), and the header by the first share too
    (rank 0 reads it before the others report)."""
    if path.endswith(".dcp"):
        return _verify_folder(path, share)
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


def _verify_folder(path, share):
    if not os.path.isdir(path):
        return "not a folder"
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        listed = sorted(files.items())
        for _, (size, digest) in listed:
            assert isinstance(size, int) and isinstance(digest, str)
    except FileNotFoundError:
        return f"no {MANIFEST}: not a whole checkpoint of this project"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
        return f"its {MANIFEST} is damaged"
    if HEADER not in files or ".metadata" not in files:
        return f"its {MANIFEST} lists no {HEADER} or .metadata"
    for i, (name, (size, digest)) in enumerate(listed):
        file = os.path.join(path, name)
        try:
            if os.path.getsize(file) != size:
                return f"{name} is {os.path.getsize(file)} bytes, not {size}: the folder is truncated or " \
                       f"damaged"
            mine = i % share[1] == share[0] or (name == HEADER and share[0] == 0)
            if mine and _file_digest(file) != digest:
                return f"checksum mismatch in {name}: the folder is damaged"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror or e})"
    return None


def load_checkpoint(path, sharded=False):
    """A checkpoint (a .pt file or a .dcp folder), verified; or the newest one of a run folder.
    -> the dict a run saved: the model's full state dict, torch.optim's state dict, the step, ...
    sharded (FSDP; collective): see _read_sharded."""
    if sharded and dist.is_initialized():
        return _read_sharded(lambda share: _load(path, share, whole=False))
    return _load(path)


def _load(path, share=(0, 1), whole=True):
    if os.path.isdir(path) and not path.endswith((".pt", ".dcp")):
        files = checkpoint_files(path)
        if not files:
            raise UserError(f"no checkpoint in {path}; train first, or use init_from=scratch")
        why = verify_checkpoint(files[0], share)
        if why and len(files) > 1:
            raise UserError(f"the newest checkpoint of {path}, {files[0]}, is unusable ({why}); the one "
                            f"before it is {files[1]}: pass that file, or remove the unusable one")
        path = files[0]
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    why = verify_checkpoint(path, share)
    if why:
        raise UserError(f"checkpoint {path} is unusable ({why})")
    return _read(path, whole)


def _read(path, whole=True):
    """A verified checkpoint's dict, read as data (stepgpt/safeload.py: a file that asks to run code
    is refused). A .dcp folder's: its header with the tensors read whole into it on this process
    (whole=True), or left where they are (ckpt["dcp"]: the folder, from which each FSDP rank reads
    its rows: stepgpt/sharding.py)."""
    with open(os.path.join(path, HEADER) if path.endswith(".dcp") else path, "rb") as f:
        f.seek(len(MAGIC) + DIGEST_HEX + 1)
        ckpt = safeload.load(f, f.name)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    if path.endswith(".dcp"):   # read now, before any work (FSDP: on rank 0, before the ranks build)
        safeload.read_metadata(os.path.join(path, ".metadata"))
    if path.endswith(".dcp") and whole:
        empty = lambda v: torch.empty(v[1], dtype=v[2])  # noqa: E731
        tensors = {"model": {k: empty(v) for k, v in ckpt["model"].items()},
                   "optimizer": {i: {k: empty(v) for k, v in s.items() if sharding.is_spec(v)}
                                 for i, s in ckpt["optimizer"]["state"].items()}}
        with warnings.catch_warnings():   # that it loads on one process, as asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            safeload.load_dcp(tensors, path, no_dist=True)   # each tensor whole, on this process alone
        ckpt["model"] = tensors["model"]
        ckpt["optimizer"]["state"] = {i: {**s, **tensors["optimizer"][i]}
                                      for i, s in ckpt["optimizer"]["state"].items()}
    elif path.endswith(".dcp"):
        ckpt["dcp"] = path
    return ckpt


def resume_checkpoint(out_dir, sharded=False):
    """The checkpoint a resumed run continues from: the newest of out_dir (claim() has moved aside
    the one after it for --init_from=resume_previous). A damaged newest one is an error that names
    the fallback, never a silent switch to it. -> (path, checkpoint). sharded (FSDP; collective): see
    _read_sharded."""
    if sharded and dist.is_initialized():
        return _read_sharded(lambda share: _resume(out_dir, share, whole=False))
    return _resume(out_dir)


def _resume(out_dir, share=(0, 1), whole=True):
    files = checkpoint_files(out_dir)
    if not files:
        raise UserError(f"no checkpoint in {out_dir} to resume from; train first, or use init_from=scratch")
    why = verify_checkpoint(files[0], share)
    if why:
        raise UserError(f"checkpoint {files[0]} is unusable ({why}); {_previous_hint(files)}")
    return files[0], _read(files[0], whole)


def _previous_hint(files):
    if len(files) > 1:
        return f"resume from the one before it, {files[1]}, with --init_from=resume_previous"
    return "no earlier checkpoint is left: start again in another --out_dir"


def _read_sharded(read):
    """read(share) (_load or _resume, tensors left in place) on rank 0 alone, as FSDP reads a
    checkpoint: no rank but rank 0 ever holds one whole. A .pt file's tensors stay on rank 0 (the
    other ranks get the rest, and FSDP sends each its rows: stepgpt/sharding.py); a .dcp folder's
    header goes to every rank, each of which then hashes its share of the folder's files, and FSDP
    reads each rank's rows from them. Rank 0's error, or any rank's finding, is every rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result, got = None, [None, None]
    if rank == 0:
        try:
            result = read((0, world))
        except UserError as e:
            got[1] = e
        else:
            path, ckpt = result if isinstance(result, tuple) else (None, result)
            if "dcp" not in ckpt:
                ckpt = {**{k: v for k, v in ckpt.items() if k not in ("model", "optimizer")},
                        "model": None, "optimizer": None}
            got[0] = (path, ckpt, isinstance(result, tuple))
    dist.broadcast_object_list(got, src=0)
    if got[1] is not None:
        raise got[1]
    path, ckpt, pair = got[0]
    if "dcp" in ckpt:
        whys = [None] * world
        dist.all_gather_object(whys, verify_checkpoint(ckpt["dcp"], (rank, world)) if rank else None)
        why = next((w for w in whys if w), None)
        if why:
            files = checkpoint_files(os.path.dirname(ckpt["dcp"]))
            before = files[files.index(ckpt["dcp"]):] if ckpt["dcp"] in files else [ckpt["dcp"]]
            raise UserError(f"checkpoint {ckpt['dcp']} is unusable ({why}); {_previous_hint(before)}")
    if result is not None:
        return result
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

def claim(out_dir, init_from, dry_run=False):
    """A run owns the checkpoints of its out_dir: a fresh run into a folder that holds another run's
    would lose its own to their rotation (it keeps the highest steps) and leave a resume to pick up
    theirs. So init_from=auto continues the run the folder holds (check_resume refuses another
    run's) and starts one where it holds none; any other fresh start there (scratch, a checkpoint's
    weights, hf:) stops before any work; resume continues; and --init_from=resume_previous moves the
    newest aside (to NAME.superseded, kept), so that the run continuing from the one before it owns
    the folder's newest file. Call it on rank 0 holding out_dir's lock, before the other ranks look
    (the temp files of an interrupted save are then ours to remove); a dry run decides the same and
    removes or moves nothing. -> what init_from does here: auto's choice (resume or scratch), or
    init_from."""
    for path in [] if dry_run else remove_temp_files(out_dir):
        print(f"removed {path}: a save that a kill interrupted", flush=True)
    files = checkpoint_files(out_dir)
    if init_from == "auto":
        return "resume" if files else "scratch"
    if files and init_from not in ("resume", "resume_previous"):
        raise UserError(f"out_dir={out_dir!r} holds the checkpoints of an earlier run (newest {files[0]}) "
                        f"and init_from={init_from} starts a new one: continue that run with the default "
                        f"init_from=auto (or --init_from=resume), or start this one in another --out_dir "
                        f"(or delete them)")
    if init_from == "resume_previous":
        if len(files) < 2:
            raise UserError(f"no earlier checkpoint in {out_dir} to resume from (it holds {len(files)}); use "
                            f"--init_from=resume")
        why = verify_checkpoint(files[1])
        if why:
            raise UserError(f"the checkpoint before the newest, {files[1]}, is unusable ({why}) and no "
                            f"earlier one is kept: start again in another --out_dir")
        if dry_run:
            return init_from
        if os.path.isdir(files[0] + ".superseded"):   # a .dcp folder moved aside before (a file is replaced)
            shutil.rmtree(files[0] + ".superseded")
        os.replace(files[0], files[0] + ".superseded")
        print(f"moved {files[0]} aside to {files[0]}.superseded: the run continues from {files[1]}",
              flush=True)
    return init_from


def announce(run, path=None, ckpt=None):
    """The log's first line (rank 0): what init_from did, and from which checkpoint."""
    if not run.master:
        return
    cfg = run.cfg
    auto = f"init_from=auto: out_dir={cfg.out_dir!r} holds " if cfg.init_from == "auto" else ""
    if path is None:
        line = f"{auto}no checkpoint: starting the run from scratch" if auto else \
            f"starting the run from scratch in out_dir={cfg.out_dir!r}"
    else:
        verb = "resuming" if run.resuming else "starting"
        line = f"{auto and auto + 'this run: '}{verb} from {path} (step {ckpt.get('iter_num', 0)})"
    print(line, flush=True)


def save(run, model, opt, it, best_val, evaluated):
    """Every rank calls it (ZeRO-1 gathers the optimizer state; FSDP gathers the model's and the
    optimizer's shards whole to rank 0's CPU, or writes them sharded: _sharded_save); rank 0 writes
    out_dir/ckpt-<it>.pt (or ckpt-<it>.dcp). `evaluated`: the checkpoint holds step `it`'s stage
    work and eval (written at the eval), or is the state after step it-1 (written on a signal),
    which a resume then evaluates first. -> the checkpoint's path."""
    cuda = run.device.type == "cuda"
    numpy_rng = np.random.get_state()   # its uint32 array kept as a tensor: the file holds no numpy object
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": (numpy_rng[0], torch.from_numpy(numpy_rng[1].astype(np.int64)), *numpy_rng[2:]),
           "cuda": torch.cuda.get_rng_state(run.device) if cuda else None}
    meta = {"model_args": asdict(model.config), "iter_num": it, "best_val_loss": best_val,
            "evaluated": evaluated, "config": asdict(run.cfg), "meta": run.meta, "kernels": kernels.state(),
            "wandb_id": run.log.wandb_id, "rng": rng}
    if sharding.sharded(model) and _sharded_save(run, model, opt):
        path = checkpoint_path(run.cfg.out_dir, it, sharded=True)
        sd = opt.state_dict()   # torch.optim's layout (index keys), its tensors the live DTensors
        state = {"model": model.state_dict(), "optimizer": sd["state"]}
        layout = {i: {k: sharding.spec(v) if torch.is_tensor(v) else v for k, v in st.items()}
                  for i, st in sd["state"].items()}
        header = {**meta, "model": {k: sharding.spec(v) for k, v in state["model"].items()},
                  "optimizer": {**sd, "state": layout}}
        _save_folder(run, path, state, header)
        return path
    path = checkpoint_path(run.cfg.out_dir, it)
    if sharding.sharded(model):
        weights, optimizer = sharding.full_state(model), sharding.full_optimizer_state(opt)
    else:
        weights, optimizer = model.state_dict(), optim.state_dict(opt)
    if run.master:
        save_checkpoint(path, {**meta, "model": weights, "optimizer": optimizer},
                        keep=run.cfg.keep_checkpoints)
    if run.world > 1:
        dist.barrier()   # a save that failed on rank 0 must not leave the others training on
    return path


def host_memory():
    """This machine's RAM: the physical memory, or a container's limit (cgroup v2) where lower."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    except OSError:
        pass
    return ram


def gather_fits(nbytes, ram):
    """fsdp_checkpoint="auto": whether a checkpoint of `nbytes` (weights and AdamW state, whole) is
    gathered to rank 0, which has `ram` bytes of RAM."""
    return nbytes <= GATHER_SHARE * ram


def _sharded_save(run, model, opt):
    """Whether FSDP writes this checkpoint sharded (torch.distributed.checkpoint) rather than gathered
    to rank 0: fsdp_checkpoint says so, or with "auto" the model's and AdamW state's whole size is
    over a quarter of rank 0's RAM (rank 0 decides: the ranks' hosts may differ)."""
    if run.cfg.fsdp_checkpoint != "auto":
        return run.cfg.fsdp_checkpoint == "sharded"
    nbytes = _tensor_bytes([p for p in model.parameters()] + [list(s.values()) for s in opt.state.values()])
    decided = [None]
    if run.master:
        decided[0] = not gather_fits(nbytes, host_memory())
    dist.broadcast_object_list(decided, src=0)
    return decided[0]


def _save_folder(run, path, state, header):
    """Write a checkpoint folder (collective): each rank writes its rows of `state` into path.tmp/ with
    torch.distributed.checkpoint (its files fsynced), rank 0 the header beside them; each rank hashes
    a share of the files; rank 0 writes the manifest (each file's size and digest), fsyncs and
    renames the folder, then rotates the old ones. A failed write on any rank is one line on every
    rank, with the temp folder removed and the older checkpoints as they were."""
    tmp, rank, world, master = path + ".tmp", dist.get_rank(), dist.get_world_size(), run.master
    names, files, kept = [None], {}, _KeptErrors()

    def attempt(fn):   # fn() on this rank, then the first failed write of any rank's (collective)
        error = other = None
        try:
            fn()
        except CheckpointException as e:   # DCP raises it on every rank, whichever rank's write failed
            error = next((x for x, _ in e.failures.values() if isinstance(x, OSError)), None) or kept.error
            other = None if error else e
        except OSError as e:
            error = e
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
        if error is None and other is not None:   # not a failed write: a bug, shown as it is
            raise other
        return error

    def hash_share():
        for name in names[0][rank::world]:
            file = os.path.join(tmp, name)
            files[name] = [os.path.getsize(file), _file_digest(file)]

    def finish():
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        # this step's checkpoint saved before (on a signal, before its eval): renamed away (a kill
        # leaves it to remove_temp_files) first, as no rename replaces a folder that holds files
        old = path[:-len(".dcp")] + ".old.dcp.tmp" if os.path.isdir(path) else None
        if old:
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
        if old:
            shutil.rmtree(old)

    error = attempt(lambda: master and os.makedirs(tmp))
    writer = dcp.FileSystemWriter(tmp, sync_files=True)   # each rank's file fsynced, .metadata too
    writer.fs = kept
    error = error or attempt(lambda: dcp.save(state, storage_writer=writer))
    error = error or attempt(lambda: master and _write_file(os.path.join(tmp, HEADER), header))
    error = error or attempt(lambda: master and names.__setitem__(0, sorted(os.listdir(tmp))))
    if error is None:
        dist.broadcast_object_list(names, src=0)
        error = attempt(hash_share)
    if error is None:
        shares = [None] * world
        dist.all_gather_object(shares, files)
        files.update({n: v for share in shares for n, v in share.items()})
        error = attempt(lambda: master and finish())
    if error is not None:
        if master and os.path.isdir(tmp):
            shutil.rmtree(tmp)
        raise _write_failed(path, error, _tensor_bytes(state)) from None
    if master:
        _rotate(os.path.dirname(path) or ".", run.cfg.keep_checkpoints)
    dist.barrier()


def check_resume(run, path, ckpt):
    """A checkpoint resumes only under the config it was trained with: the model's keys, the stages
    and the data must match (the data's token counts too: a folder prepared again from another text
    is another data set), the optimizer too (its state's layout differs), and the schedule must not
    end before it; with init_from=auto every key that changes what the run computes (the seed, the
    schedule, ...) must match too (the folder may hold another run's), else other changes warn (the
    run will not replay exactly). -> True where the checkpoint is the run's end (said in one line):
    nothing to train."""
    cfg, meta = run.cfg, run.meta
    declared = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cfg)}
    # a key the checkpoint's config lacks (older code) had its default's effect
    theirs = {**declared, **ckpt["config"]}
    theirs["data_dir"] = os.path.normpath(theirs.get("data_dir", ""))   # "data/x/" is "data/x"
    ours = {**asdict(cfg), "data_dir": os.path.normpath(cfg.data_dir)}
    fixed = {f.name for f in fields(GPTConfig)} | STAGE_KEYS

    def diff(keys):
        return [f"{k}={theirs.get(k)!r} (config says {v!r})" for k, v in ours.items()
                if k in keys - RUNTIME_KEYS and theirs.get(k) != v]
    other = diff(set(ours)) if cfg.init_from == "auto" else []
    if other:
        raise UserError(f"out_dir={cfg.out_dir!r} holds the checkpoints of another run ({path}: "
                        f"{', '.join(other[:3])}): run it with the config it was trained with, or continue "
                        f"it with these changes with --init_from=resume, or start this run in another "
                        f"--out_dir")
    if diff(fixed):
        raise UserError(f"checkpoint {path} is of a different model: {', '.join(diff(fixed)[:3])}; resume "
                        f"with the config it was trained with, or use a new out_dir")
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
    if it > run.total_iters:
        raise UserError(f"checkpoint {path} is at step {it}, past the end of this run's schedule "
                        f"({run.total_iters} steps: batch_size, gradient_accumulation_steps, max_iters or "
                        f"stage_tokens changed?); resume with the schedule it was trained with")
    if 0 < cfg.stop_at < it:
        raise UserError(f"stop_at={cfg.stop_at} is before checkpoint {path}'s step {it}: give a later "
                        f"step, or 0 to train to the end")
    if it == run.total_iters and ckpt.get("evaluated", True):
        if run.master:
            print(f"out_dir={cfg.out_dir!r} holds this run, finished: {path} is at the end of its schedule "
                  f"(step {it}); nothing to train", flush=True)
        return True
    changed = [k for k, v in ours.items() if k not in RUNTIME_KEYS and theirs.get(k) != v]
    if changed and run.master:
        print(f"warning: resuming with changed {', '.join(changed)}: the run will not replay exactly",
              flush=True)
    return False


def restore(ckpt, device, model, opt):
    """What a resumed run takes back besides the model: the optimizer state (under FSDP each rank
    keeps its rows of it), the RNG states, and the kernels' measured paths and tuned configs (so it
    computes the same way)."""
    if sharding.sharded(model):
        sharding.load_optimizer(opt, ckpt)
    else:
        opt.load_state_dict(ckpt["optimizer"])
    kernels.load_state(ckpt.get("kernels", {}))
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    name, keys, *rest = ckpt["rng"]["numpy"]   # keys: a tensor, or a numpy array in older files
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    random.setstate(ckpt["rng"]["python"])
