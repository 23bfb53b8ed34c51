"""Read a folder that data/prepare.py wrote (train.bin, val.bin, meta.json), checked before training."""
import json
import os

import numpy as np

from stepgpt.errors import UserError

META_KEYS = ("tokenizer", "vocab_size", "eot_token", "dtype")


def read_meta(data_dir):
    """meta.json of a prepared folder, or a one-line error saying how to prepare it."""
    path = os.path.join(data_dir, "meta.json")
    fix = f"run: python data/prepare.py --out {data_dir}"
    if not os.path.isfile(path):
        raise UserError(f"no prepared data in {data_dir} (meta.json missing); {fix}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); {fix}") from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; it was not written by data/prepare.py: {fix}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{path} names dtype {meta['dtype']!r}, not uint16 or uint32; {fix}")
    return meta


def check_vocab(vocab_size, meta, data_dir):
    """The data's vocabulary, checked against a config's vocab_size (0: take the data's)."""
    if vocab_size and vocab_size != meta["vocab_size"]:
        raise UserError(f"{data_dir} holds a {meta['vocab_size']}-token vocabulary but the config is for "
                        f"vocab_size={vocab_size}: prepare the data with --vocab_ranks={vocab_size - 1}, "
                        f"or set --vocab_size=0")
    return meta["vocab_size"]


def load_data(data_dir, block_size, vocab_size=0):
    """-> ({"train": tokens, "val": tokens} as memmaps, meta), every check done before training."""
    meta = read_meta(data_dir)
    check_vocab(vocab_size, meta, data_dir)
    dtype = np.dtype(meta["dtype"])
    data = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        fix = f"re-run: python data/prepare.py --out {data_dir}"
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise UserError(f"{path} is missing or empty; {fix}")
        if os.path.getsize(path) % dtype.itemsize:
            raise UserError(f"{path} holds {os.path.getsize(path)} bytes, not a whole number of {dtype.name} "
                            f"tokens: it is truncated or damaged; {fix}")
        arr = np.memmap(path, dtype=dtype, mode="r")
        if len(arr) <= block_size + 1:
            raise UserError(f"{path} has {len(arr)} tokens, not more than block_size={block_size}+1; "
                            f"lower block_size or prepare more text")
        # a full scan is cheap up to ~1e9 tokens; beyond that trust the vocabulary in meta.json
        top = (int(max(arr[i:i + 2**24].max() for i in range(0, len(arr), 2**24)))
               if len(arr) < 2**30 else meta["vocab_size"] - 1)
        if top >= meta["vocab_size"]:
            raise UserError(f"{path} holds token id {top} >= vocab size {meta['vocab_size']}; the data was "
                            f"prepared with another tokenizer: re-run data/prepare.py or fix meta.json")
        data[split] = arr
    return data, meta
