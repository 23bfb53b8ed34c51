"""Reading checkpoints as data: opening one, from anywhere, runs no code from it.

torch.save and torch.distributed.checkpoint (DCP) write pickles, and a full unpickling calls any
function the file names: a checkpoint someone posted could run a command the moment sample.py opens
it, and its header's checksum would match (whoever wrote the file wrote the digest too). Our own
files hold only data, so every read admits only what they hold, and a file that asks for anything
else is refused in one line that names it and what it asked for, before it is loaded:

- a .pt file's payload and a .dcp folder's header.pt: torch.load(weights_only=True), torch's own
  restricted unpickler (tensors, containers, numbers, strings, dtypes), plus the few numpy names
  that the RNG state of the files written before the state was kept as a tensor needs (OLD_FILES);
- a .dcp folder's .metadata, which DCP's FileSystemReader unpickles in full (pickle, unrestricted):
  MetadataReader reads it through an unpickler that admits DCP's own metadata classes and the torch
  types they hold (METADATA_GLOBALS) and nothing else;
- its tensors: DCP reads each with torch.load(weights_only=True); an entry its metadata declares
  as pickled bytes DCP would unpickle in full too, and ours hold none (every dcp.load here
  asks for tensors alone), so load_dcp refuses one.

docs/trust.md says what is data and what is code in this project. tests/test_safeload.py builds
the files an attacker would and runs every command on them.
"""
import os
import pathlib
import pickle

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from stepgpt.errors import UserError

# What the numpy RNG state (np.random.get_state()'s uint32 array) of a checkpoint written before
# the state was kept as a tensor needs: the array, its dtype, and the function that rebuilds it
# (under numpy 2's module name and numpy 1's: a file names the one it was written under). torch's
# documentation names these as the ones that load numpy arrays weights-only.
_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
OLD_FILES = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
             (_reconstruct, "numpy._core.multiarray._reconstruct"),
             (_reconstruct, "numpy.core.multiarray._reconstruct")]

# What a .metadata file of DCP may name, (module, name) -> the object: DCP's metadata classes, the
# torch types their fields hold, and the path DCP records the folder under (its pure class: a name
# that touches no file system, readable on any OS)
METADATA_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    **{(module, n): getattr(pathlib, "Pure" + n.removeprefix("Pure"))
       for module in ("pathlib", "pathlib._local")
       for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


def _refused(path, what):
    """The one line for checkpoint file `path`, which `what` (it asks for builtins.exec, ...)."""
    return UserError(f"checkpoint {path} {what}: a checkpoint of this project holds only tensors and plain "
                     f"data, so it was not written by step-gpt or was changed since; it was not loaded, and "
                     f"nothing in it ran")


def load(f, path):
    """The object torch.save wrote into the open file `f` from its position on (the payload of
    checkpoint `path`), read weights-only: tensors and plain data, and OLD_FILES' numpy arrays. A
    file that names anything else is refused, naming all it asks for (a static look at its
    pickle, which runs nothing), or what torch's reader stopped at."""
    start = f.tell()
    try:
        with torch.serialization.safe_globals(OLD_FILES):
            asked = torch.serialization.get_unsafe_globals_in_checkpoint(f)
            if asked:
                raise _refused(path, f"asks for {', '.join(asked)} while it is read")
            f.seek(start)
            return torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, ValueError) as e:   # ValueError: not a torch.save archive
        lines, mark = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__], \
            "WeightsUnpickler error:"   # torch.load's reason follows it, after its advice
        at = next((i for i, ln in enumerate(lines) if mark in ln), None)
        why = lines[0] if at is None else lines[at].split(mark)[1].strip() or lines[at + 1]
        raise _refused(path, f"holds what a reader of data refuses ({why})") from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path):
        super().__init__(f)
        self.path = path

    def find_class(self, module, name):
        if (module, name) not in METADATA_GLOBALS:
            raise _refused(self.path, f"asks for {module}.{name} while it is read")
        return METADATA_GLOBALS[(module, name)]


def read_metadata(path):
    """A .dcp folder's metadata (the file `path`), unpickled admitting only METADATA_GLOBALS."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"checkpoint {path} is unreadable ({e.strerror or e})") from None
    except Exception as e:   # a damaged pickle: unpickling raises many kinds
        raise UserError(f"checkpoint {path} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UserError(f"checkpoint {path} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class MetadataReader(dcp.FileSystemReader):
    """DCP's reader of a checkpoint folder, its .metadata read through read_metadata."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")   # as FileSystemReader names a rank's own metadata file
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata(os.path.join(self.path, name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, refusing an entry the metadata declares as pickled bytes (DCP would unpickle it
    in full): every state dict read here holds tensors alone."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value):
        what = f"declares {read_item.dest_index.fqn} pickled bytes (DCP unpickles them in full), not a tensor"
        raise _refused(os.path.join(self.path, ".metadata"), what)


def load_dcp(state, path, no_dist=False):
    """dcp.load of the tensors `state` from the folder `path` (collective unless no_dist), its
    metadata and entries read as data. A refusal on any rank is every rank's one line."""
    try:
        dcp.load(state, storage_reader=MetadataReader(path), planner=_TensorsOnly(path), no_dist=no_dist)
    except CheckpointException as e:
        refusal = next((x for x, _ in e.failures.values() if isinstance(x, UserError)), None)
        if refusal is None:
            raise
        raise refusal from None
