"""The LLaMA-on-C4 yardstick (docs/yardstick.md), offline and tiny: local shards in C4's (json.gz),
FineWeb-Edu's (parquet) and JSON-lines formats and a small Hugging Face tokenizer, all written here;
data/prepare.py on them (both modes, in parallel, resumed after a kill, an unreadable shard named, the
val split from C4's validation shards);
the rows' batches and their masked padding; the eight configs; the page's plan table against
bench/yardstick.py --plan; and the page's commands scaled down in size: the shards prepared, a run
stopped early on one process, then the grid finishing it and STEP beside it under torchrun on two
ranks, its table, the perplexity, the export and its tokenizer."""
import gzip
import json
import math
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from data import prepare as prep
from data.load import HFTokenizer, eval_batches, load_data, row_order, sample_batch, tokenizer_of
from model import GPT
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import HANG, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "yardstick.md")
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there been one all we their has would when if so no out up said "
         "what its about into than them can only other new some could time these two may then first any "
         "my now such like our over man me even most made after also did many before must through").split()


def documents(seed, n):
    """n documents of 1 to 60 words, a few of them with digits and punctuation."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 60))) + (f", {i}." if i % 3 else ".")
            for i in range(n)]


def shards_and_tokenizer(root):
    """C4's layout (en/c4-train.NNNNN-of-01024.json.gz and en/c4-validation.NNNNN-of-00008.json.gz:
    text, timestamp, url), FineWeb-Edu's (parquet, several row groups), a JSON-lines file, and a
    Unigram tokenizer with T5's special tokens (<pad> 0, </s> 1, <unk> 2, a sentinel past them)
    trained on the documents, saved by transformers."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    os.makedirs(root / "c4" / "en")
    for s, name, n in ((0, "train.00000-of-01024", 150), (1, "train.00001-of-01024", 150),
                       (30, "validation.00000-of-00008", 40), (31, "validation.00001-of-00008", 40)):
        with gzip.open(root / "c4" / "en" / f"c4-{name}.json.gz", "wt", encoding="utf-8") as f:
            for text in documents(s, n):
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "x"}) + "\n")
    fw = root / "fineweb-edu" / "sample" / "10BT"
    os.makedirs(fw)
    for s in range(2):
        texts = documents(10 + s, 120)
        table = pa.table({"text": texts, "id": [f"<urn:{i}>" for i in range(len(texts))],
                          "score": [3.0] * len(texts)})
        pq.write_table(table, fw / f"{s:03d}_00000.parquet", row_group_size=50)
    with open(root / "extra.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n\n" for t in documents(20, 30))   # blank lines: none
    tk = Tokenizer(models.Unigram())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tk.train_from_iterator(documents(0, 300), trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                            additional_special_tokens=["<extra_id_0>"]).save_pretrained(root / "tok")
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    pytest.importorskip("pyarrow")
    pytest.importorskip("transformers")
    return shards_and_tokenizer(tmp_path_factory.mktemp("shards"))


def read_split(out, meta):
    return [np.fromfile(os.path.join(out, f"{s}.bin"), dtype=meta["dtype"]) for s in ("train", "val")]


def page_commands():
    """The page's ```bash lines, continuations joined, comments dropped."""
    text = open(PAGE, encoding="utf-8").read()
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        lines += [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()
                  if line.strip()]
    return lines


def scaled(argv, **values):
    """A command's arguments with some --key values replaced (sizes and paths)."""
    out, i = [], 0
    while i < len(argv):
        key = argv[i][2:].split("=")[0] if argv[i].startswith("--") else None
        if key in values:
            out.append(f"--{key}={values[key]}")
            i += 1 if "=" in argv[i] else 2
        else:
            out.append(argv[i])
            i += 1
    return out


# ----------------------------------------------------------------------------------------------
# the tokenizer

def test_a_hugging_face_tokenizer_folder(shards):
    enc = HFTokenizer(str(shards / "tok"), "hf:tok")
    assert (enc.eot_token, enc.pad_token, enc.unk_token) == (1, 0, 2)
    sentinel = enc.backend.token_to_id("<extra_id_0>")
    assert sentinel == enc.backend.get_vocab_size() - 1 and enc.n_vocab == sentinel   # left out
    text = documents(0, 1)[0]
    assert enc.decode(enc.encode_ordinary(text)) == text
    ids = enc.encode_ordinary("the </s> of <pad> and <extra_id_0>")
    assert max(ids) < enc.n_vocab and not {0, 1} & set(ids) and 2 in ids   # spelled special tokens: <unk>
    assert 1 in enc.encode("the </s>", allowed_special="all")                # the exported reading


def test_optional_packages_say_how_to_install(shards, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install transformers==5\.25\.0"):
        prep.prepare(str(shards / "c4"), str(tmp_path / "a"), tokenizer=f"hf:{shards / 'tok'}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(UserError, match=r"needs Hugging Face tokenizers: pip install transformers"):
        HFTokenizer(str(shards / "tok"), "hf:tok")
    monkeypatch.undo()
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"000_00000\.parquet: reading parquet needs pyarrow: pip install "
                                          r"pyarrow==26\.0\.1"):
        prep.prepare(str(shards / "fineweb-edu"), str(tmp_path / "b"), vocab_ranks=512)


# ----------------------------------------------------------------------------------------------
# prepare: shards, both modes, parallel, resumable, locked, bad shards

def test_shards_of_every_format_stream_in_parallel(shards, tmp_path):
    """A folder of C4 json.gz, FineWeb-Edu parquet and JSON-lines shards, packed, with the Hugging
    Face tokenizer: 2 processes write the files of 1, documents in sorted-path order, the tokenizer
    carried in the folder."""
    tok = f"hf:{shards / 'tok'}"
    metas = [prep.prepare(str(shards), str(tmp_path / f"w{w}"), tokenizer=tok, workers=w) for w in (1, 2)]
    assert metas[0] == metas[1] and metas[0]["n_documents"] == 2 * 150 + 2 * 40 + 2 * 120 + 30
    one, two = (read_split(tmp_path / f"w{w}", metas[0]) for w in (1, 2))
    assert all((a == b).all() for a, b in zip(one, two))
    assert sorted(os.listdir(tmp_path / "w2")) == ["meta.json", "prepare.lock", "tokenizer", "train.bin",
                                                    "val.bin"]
    meta, enc = metas[0], tokenizer_of(metas[0], str(tmp_path / "w2"))
    assert (meta["mode"], meta["vocab_size"], meta["eot_token"], meta["vocab_ranks"]) == (
        "packed", enc.n_vocab, 1, 0)
    stream = np.concatenate(one).tolist()
    first = stream[:stream.index(1)]
    assert enc.decode(first) == documents(0, 1)[0]   # c4/en/c4-train.00000 sorts first


def test_sequences_are_one_document_per_row(shards, tmp_path):
    """--mode=sequences: each row a document's first seq_len - 1 tokens and eot (T5's truncation),
    padded with the tokenizer's pad; the split between whole rows; the batches mask the padding."""
    meta = prep.prepare(str(shards / "c4" / "en" / "c4-train.00000-of-01024.json.gz"), str(tmp_path / "c4"),
                        tokenizer=f"hf:{shards / 'tok'}", mode="sequences", seq_len=16, workers=2)
    assert (meta["mode"], meta["seq_len"], meta["pad_token"], meta["n_documents"]) == (
        "sequences", 16, 0, 150)
    enc = tokenizer_of(meta, str(tmp_path / "c4"))
    rows = np.concatenate(read_split(tmp_path / "c4", meta)).reshape(-1, 16)
    for row, text in zip(rows, documents(0, 150)):
        ids = enc.encode_ordinary(text) + [1]
        ids = ids if len(ids) <= 16 else ids[:15] + [1]
        assert row.tolist() == ids + [0] * (16 - len(ids))
    assert meta["val_tokens"] % 16 == 0 and (rows[:, -1] == 1).any() and (rows[:, -1] == 0).any()
    data, _ = load_data(str(tmp_path / "c4"), 15)
    assert data["val"].shape == (meta["val_tokens"] // 16, 16)
    x, y = sample_batch(data, "train", 8, 15, seed=None, index=0)
    rows = data["train"][row_order(len(data["train"]), 0)[:8]].astype(np.int64)
    assert (x.numpy() == rows[:, :-1]).all()
    assert (y.numpy() == np.where(rows[:, 1:] == 0, -1, rows[:, 1:])).all()
    with pytest.raises(UserError, match="rows of 16 tokens, which need block_size >= 15"):
        load_data(str(tmp_path / "c4"), 14)
    # tiktoken has no pad token: one past its vocabulary
    meta = prep.prepare(str(shards / "extra.jsonl"), str(tmp_path / "tt"), vocab_ranks=512, mode="sequences",
                        seq_len=8)
    assert (meta["pad_token"], meta["vocab_size"], meta["eot_token"]) == (513, 514, 512)
    with pytest.raises(ValueError, match="use --mode=packed .no --seq_len., or --mode=sequences --seq_len=N"):
        prep.prepare(str(shards / "extra.jsonl"), str(tmp_path / "tt"), mode="sequences")


def test_a_killed_preparation_of_shards_resumes(shards, tmp_path, monkeypatch, capsys):
    """Killed inside the second C4 shard and started again: the parquet shards and the first C4 shard
    already read are skipped unread (row counts, lines counted), and the files are an uninterrupted
    run's."""
    src = tmp_path / "src"
    os.makedirs(src)
    for name in ("fineweb-edu/sample/10BT/000_00000.parquet", "c4/en/c4-train.00000-of-01024.json.gz",
                 "c4/en/c4-train.00001-of-01024.json.gz"):
        os.symlink(shards / name, src / f"{len(os.listdir(src))}-{os.path.basename(name)}")
    tok, real = f"hf:{shards / 'tok'}", prep.file_texts
    clean = prep.prepare(str(src), str(tmp_path / "clean"), tokenizer=tok, mode="sequences", seq_len=16,
                         workers=1)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)

    def killed(file, skip):
        for i, text in enumerate(real(file, skip)):
            if file.endswith("00001-of-01024.json.gz") and i == 60:
                raise KeyboardInterrupt
            yield text
    monkeypatch.setattr(prep, "file_texts", killed)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(src), str(tmp_path / "out"), tokenizer=tok, mode="sequences", seq_len=16, workers=2)
    state = json.loads((tmp_path / "out" / "tokens.tmp.json").read_text())
    assert 120 + 150 <= state["docs_read"] <= 120 + 150 + 60
    read = []
    monkeypatch.setattr(prep, "file_texts", lambda file, skip: read.append((os.path.basename(file), skip))
                        or real(file, skip))
    capsys.readouterr()
    meta = prep.prepare(str(src), str(tmp_path / "out"), tokenizer=tok, mode="sequences", seq_len=16,
                        workers=2)
    assert f"resuming: {state['n_docs']:,} documents" in capsys.readouterr().out
    assert read[0] == ("1-c4-train.00000-of-01024.json.gz", state["docs_read"] - 120)   # the parquet: unread
    assert meta == {**clean, "source": meta["source"]}
    assert all((a == b).all() for a, b in zip(read_split(tmp_path / "out", meta),
                                              read_split(tmp_path / "clean", clean)))


def test_a_killed_val_split_resumes_and_is_kept(shards, tmp_path, monkeypatch, capsys):
    """Killed inside the val split (C4's validation shards), then inside the train split, then run
    to the end: the val split goes on from its last commit, is not read again once done, and the
    files are an uninterrupted run's."""
    c4 = shards / "c4" / "en"
    src = str(c4 / "c4-train.*-of-01024.json.gz")
    kw = dict(tokenizer=f"hf:{shards / 'tok'}", mode="sequences", seq_len=64, workers=2, val_tokens=2500,
              val_source=str(c4 / "c4-validation.*-of-00008.json.gz"))
    clean = prep.prepare(src, str(tmp_path / "clean"), **kw)
    assert 30 < clean["val_documents"] < 80
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)
    monkeypatch.setattr(prep, "VAL_CHUNK", 16)
    shuffled, texts = prep.shuffled_documents, prep.file_texts

    def killed_val(files, n_docs, first):
        for i, doc in enumerate(shuffled(files, n_docs, first)):
            if i == 30:
                raise KeyboardInterrupt
            yield doc
    monkeypatch.setattr(prep, "shuffled_documents", killed_val)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(src, str(out), **kw)
    state = json.loads((out / "val_tokens.tmp.json").read_text())
    assert 0 < state["docs_read"] <= 30 and not (out / "tokens.tmp").exists()
    monkeypatch.setattr(prep, "shuffled_documents", shuffled)

    def killed_train(file, skip):
        for i, text in enumerate(texts(file, skip)):
            if file.endswith("c4-train.00001-of-01024.json.gz") and i == 60:
                raise KeyboardInterrupt
            yield text
    monkeypatch.setattr(prep, "file_texts", killed_train)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(src, str(out), **kw)
    assert f"resuming: {state['n_docs']:,} documents" in capsys.readouterr().out
    assert (out / "val_tokens.tmp.done").exists() and (out / "tokens.tmp.json").exists()
    read = []
    monkeypatch.setattr(prep, "file_texts", lambda file, skip: read.append(os.path.basename(file))
                        or texts(file, skip))
    meta = prep.prepare(src, str(out), **kw)
    assert "is on disk already" in capsys.readouterr().out and read and not any("valid" in f for f in read)
    assert meta == clean
    assert all((a == b).all() for a, b in zip(read_split(out, meta), read_split(tmp_path / "clean", clean)))
    assert sorted(os.listdir(out)) == ["meta.json", "prepare.lock", "tokenizer", "train.bin", "val.bin"]


def test_an_unreadable_shard_stops_with_one_line_naming_it(shards, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    cases = {"bad.json.gz": b"not gzip at all", "torn.json.gz": gzip.compress(b'{"text": "a"}\n' * 50)[:40],
             "bad.jsonl": b'{"text": "fine"}\n{"text": "cut off\n', "notext.jsonl": b'{"content": "x"}\n',
             "number.jsonl": b'{"text": 7}\n', "bad.parquet": b"PAR1 broken"}
    for name, content in cases.items():
        folder = tmp_path / name.replace(".", "_")
        os.makedirs(folder)
        (folder / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{re.escape(str(folder / name))} cannot be read as a "
                                             rf"(JSON-lines|parquet) shard \(.*\), at document \d+ of the "
                                             rf"source: replace or remove it, then run again"):
            prep.prepare(str(folder), str(tmp_path / "out"), vocab_ranks=512, workers=1)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocolumn.parquet")
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--source={tmp_path / 'nocolumn.parquet'}",
                                      f"--out={tmp_path / 'out'}", "--vocab_ranks=512", "--workers=1"])
    with pytest.raises(SystemExit) as e:
        prep.main()
    assert str(e.value).startswith(f"error: {tmp_path / 'nocolumn.parquet'} cannot be read as a parquet")
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.json\.gz"):
        prep.prepare(str(tmp_path / "nowhere" / "*.json.gz"), str(tmp_path / "out"))


# ----------------------------------------------------------------------------------------------
# batches, loss, configs

def test_batches_of_a_stream_are_the_old_ones_and_rows_are_read_once_per_epoch():
    arr = np.arange(5000, dtype=np.uint16) % 97
    for seed in (1, 123456789):
        g = torch.Generator().manual_seed(seed)   # train.py's get_batch before rows existed
        ix = torch.randint(len(arr) - 16 - 1, (4,), generator=g).tolist()
        xy = torch.from_numpy(np.stack([arr[i:i + 17].astype(np.int64) for i in ix]))
        x, y = sample_batch({"train": arr}, "train", 4, 16, seed, index=7)
        assert torch.equal(x, xy[:, :-1]) and torch.equal(y, xy[:, 1:])
    x, _ = sample_batch({"val": arr}, "val", 4, 16, None, index=2)   # a fixed set: consecutive windows
    assert x[:, 0].tolist() == [arr[(8 + b) * 16] for b in range(4)]
    rows = np.zeros((10, 6), dtype=np.uint16)
    rows[:, 0], rows[:, 1], rows[:7, 2] = np.arange(10) + 3, 1, 1
    data = {"train": rows, "pad_token": 0}
    seen = [sample_batch(data, "train", 2, 5, None, k)[0][:, 0].tolist() for k in range(10)]
    epoch = sum(seen[:5], [])
    assert sorted(epoch) == list(range(3, 13)) and sum(seen[5:], []) != epoch   # once each, then reshuffled
    assert seen == [sample_batch(data, "train", 2, 5, 99, k)[0][:, 0].tolist() for k in range(10)]
    x, y = sample_batch(data, "train", 10, 5, None, 0)
    shuffled = rows[row_order(10, 0)].astype(np.int64)
    assert (x.numpy() == shuffled[:, :-1]).all() and (y.numpy() == np.where(shuffled[:, 1:] == 0, -1,
                                                                           shuffled[:, 1:])).all()
    real = np.cumsum((shuffled != 0).sum(1))   # 3 or 2 tokens a row, in the fixed order
    assert eval_batches({"val": rows, "pad_token": 0}, 20, 2, 5)\
        == math.ceil((np.argmax(real >= 20) + 1) / 2)
    assert eval_batches({"val": arr}, 100, 2, 16) == 4
    with pytest.raises(UserError, match="eval_tokens=30,000 needs .* holds 27 tokens: lower eval_tokens"):
        eval_batches({"val": rows, "pad_token": 0}, 30_000, 2, 5)


def test_the_chunked_loss_ignores_padding_as_the_full_one_does():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    x = torch.randint(0, 100, (3, 16))
    y = x.roll(-1, 1)
    y[0, 5:], y[1, 1:], y[2, 12:] = -1, -1, -1     # rows padded after 5, 1 and 12 targets
    full = model(x, y)[1]
    for chunk in (4, 7, 48):
        torch.testing.assert_close(model(x, y, loss_chunk=chunk)[1], full)
    keep = y != -1
    logits = model(x, y)[0]
    torch.testing.assert_close(full, torch.nn.functional.cross_entropy(logits[keep], y[keep]))


SHAPES = {"60m": (512, 1376, 8, 8, 10_000), "130m": (768, 2048, 12, 12, 20_000),
          "350m": (1024, 2736, 16, 24, 60_000), "1b": (2048, 5461, 32, 24, 100_000)}


@pytest.mark.parametrize("size", SHAPES)
def test_the_configs_are_the_published_recipe_and_step_beside_it(size):
    import grow
    d, ffn, heads, layers, steps = SHAPES[size]
    vanilla = load_config([os.path.join(ROOT, "config", f"c4_{size}.py")])
    step = load_config([os.path.join(ROOT, "config", f"c4_step_{size}.py")])
    for cfg in (vanilla, step):
        assert (cfg.n_embd, cfg.ffn_hidden, cfg.n_head, grow.final_depth(cfg), cfg.max_iters) == SHAPES[size]
        assert (cfg.vocab_size, cfg.block_size, cfg.norm_eps, cfg.tie_embeddings, cfg.data_dir) == (
            32000, 256, 1e-6, False, "data/c4")
        assert cfg.batch_size * cfg.gradient_accumulation_steps == 512
        assert all(cfg.gradient_accumulation_steps % world == 0 for world in (1, 8))   # 1 and 8 GPUs
        assert (cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.weight_decay, cfg.beta1, cfg.beta2,
                cfg.grad_clip) == (1e-3, 1e-4, steps // 10, 0.0, 0.9, 0.999, 0.0)
        assert (cfg.eval_interval, cfg.eval_tokens) == (1000, 10_000_000)
    assert grow.stage_count(vanilla) == 1 and vanilla.batch_size == step.batch_size
    assert (grow.stage_count(step), step.grow_at, step.lora_rank) == (3 if size == "1b" else 2, 0.75, 64)
    for base, twin in ((vanilla, f"c4_muon_{size}"), (step, f"c4_step_muon_{size}")):   # Muon beside each
        muon = load_config([os.path.join(ROOT, "config", f"{twin}.py")])
        assert {k for k, v in vars(base).items() if getattr(muon, k) != v} == {
            "out_dir", "optimizer", "muon_adjust_lr", "muon_lr", "zero1"}
        assert (muon.optimizer, muon.muon_adjust_lr, muon.muon_lr, muon.zero1) == (
            "muon", "match_rms_adamw", base.learning_rate, True)
    assert step.out_dir != vanilla.out_dir


def test_the_page_holds_the_plan_table_and_plan_pys_numbers(capsys):
    """`python bench/yardstick.py --plan` prints the page's table; `python plan.py
    config/c4_step_60m.py` prints the same stage peaks."""
    import plan
    from bench import yardstick
    yardstick.main(["--plan"])
    table = capsys.readouterr().out.strip()
    assert table in open(PAGE, encoding="utf-8").read()
    for name in ("c4_step_60m", "c4_step_1b"):
        plan.main([f"config/{name}.py"])
        peaks = re.search(r"step peak ([\d. ]+) GiB", capsys.readouterr().out).group(1).split()
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}`"))
        assert row.split(" | ")[5] == " / ".join(peaks)


def test_every_command_of_the_page_is_run_here():
    """Each command the page shows names a script and flags this file runs (scaled down in size)."""
    text = open(__file__, encoding="utf-8").read()
    for argv in page_commands():
        script = next(w for w in argv if w.endswith(".py"))
        assert script in text or f"{os.path.basename(script)[:-3]}.main(" in text, script
        for flag in (w.split("=")[0] for w in argv if w.startswith("--")):   # as text or scaled(key=...)
            assert f'"{flag}' in text or f" {flag}" in text or f"{flag[2:]}=" in text, (argv, flag)


def test_the_fineweb_edu_command_of_the_page(shards, tmp_path):
    """The page's FineWeb-Edu command, in-process, on this file's parquet shards, fewer documents."""
    argv = next(a[2:] for a in page_commands()
                if a[:2] == ["python", "data/prepare.py"] and "parquet" in a[3])
    argv = scaled(argv, source=shards / "fineweb-edu" / "sample" / "10BT" / "*.parquet",
                  tokenizer=f"hf:{shards / 'tok'}", seq_len=32, max_docs=200, val_fraction=0.1,
                  out=tmp_path / "fw")
    meta = prep.prepare(**vars(prep.parse_args(argv)))
    assert (meta["mode"], meta["seq_len"], meta["n_documents"]) == ("sequences", 32, 200)


def padded_row(enc, text, seq_len):
    """A document as --mode=sequences writes it: its first seq_len - 1 tokens and eot, padded with 0."""
    ids = enc.encode_ordinary(text) + [enc.eot_token]
    ids = ids if len(ids) <= seq_len else ids[:seq_len - 1] + [enc.eot_token]
    return ids + [0] * (seq_len - len(ids))


def test_the_c4_command_of_the_page(shards, tmp_path):
    """The page's C4 command, in-process, on this file's shards, fewer documents and tokens: every
    train document a row to train on, in order; the val split the validation shards' documents in
    numpy's seed-42 permutation of their index, up to the one that brings it to --val_tokens tokens,
    padding not counted."""
    argv = next(a[2:] for a in page_commands()
                if a[:2] == ["python", "data/prepare.py"] and "json.gz" in a[3])
    c4 = shards / "c4" / "en"
    argv = scaled(argv, source=c4 / "c4-train.*-of-01024.json.gz", tokenizer=f"hf:{shards / 'tok'}",
                  seq_len=64, max_docs=300, val_source=c4 / "c4-validation.*-of-00008.json.gz",
                  val_tokens=800, out=tmp_path / "c4")
    meta = prep.prepare(**vars(prep.parse_args(argv)))
    enc = tokenizer_of(meta, str(tmp_path / "c4"))
    train, val = (split.reshape(-1, 64) for split in read_split(tmp_path / "c4", meta))
    assert train.tolist() == [padded_row(enc, t, 64) for t in documents(0, 150) + documents(1, 150)]
    texts = documents(30, 40) + documents(31, 40)
    shuffled = [padded_row(enc, texts[i], 64) for i in np.random.default_rng(42).permutation(80)]
    real = np.cumsum([64 - row.count(0) for row in shuffled])
    k = int(np.searchsorted(real, 800)) + 1
    assert val.tolist() == shuffled[:k] and 800 / 64 + 1 < k < 80   # padding is not counted
    assert (meta["n_documents"], meta["train_tokens"], meta["val_documents"], meta["val_source_documents"],
            meta["val_tokens"], meta["val_unpadded_tokens"], meta["val_fraction"]) == (
        300, 300 * 64, k, 80, k * 64, real[k - 1], None)
    assert meta["val_source"] == str(c4 / "c4-validation.*-of-00008.json.gz")


# ----------------------------------------------------------------------------------------------
# the page's commands, scaled down: prepare, a run stopped early, the grid under torchrun

TINY = {"vocab_size": 0, "n_layer": 2, "n_embd": 32, "n_head": 2, "ffn_hidden": 64, "block_size": 32,
        "batch_size": 2, "gradient_accumulation_steps": 2, "max_iters": 4, "warmup_iters": 1,
        "stage_warmup_iters": 1, "eval_interval": 2, "eval_tokens": 100, "eval_iters": 1, "log_interval": 1,
        "lora_rank": 4, "device": "cpu", "sample_tokens": 8}


def run(argv, **kw):
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=HANG, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def grid(shards, tmp_path_factory):
    """The page's C4 command (python data/prepare.py ..., 2 workers, 300 documents, rows of 32, 300
    val tokens);
    `python train.py config/c4_60m.py` stopped at step 2 (a preempted job); then `python
    bench/yardstick.py --only c4_60m,c4_step_60m --launcher "torchrun --standalone --nproc_per_node=2"`,
    which finishes that run on two ranks and runs STEP beside it."""
    tmp = tmp_path_factory.mktemp("grid")
    commands = page_commands()
    argv = next(a for a in commands if a[:2] == ["python", "data/prepare.py"] and "json.gz" in a[3])
    data = tmp / "data" / "c4"
    c4 = shards / "c4" / "en"
    run([sys.executable] + scaled(argv[1:], source=c4 / "c4-train.*-of-01024.json.gz",
                                  tokenizer=f"hf:{shards / 'tok'}", seq_len=32, max_docs=300,
                                  val_source=c4 / "c4-validation.*-of-00008.json.gz", val_tokens=300,
                                  out=data) + ["--workers=2"])
    sets = [f"--{k}={v}" for k, v in {**TINY, "data_dir": data}.items()]
    out = tmp / "out-yardstick"
    assert ["python", "train.py", "config/c4_60m.py"] in commands
    first = run([sys.executable, "train.py", "config/c4_60m.py", *sets, f"--out_dir={out / 'c4_60m'}",
                 "--stop_at=2"])
    assert "stopped at step 2 (stop_at)" in first
    shown = "torchrun --standalone --nproc_per_node=8"
    assert ["python", "bench/yardstick.py", "--launcher", shown] in commands
    launcher = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node=2"   # 2 ranks
    grid_argv = ["bench/yardstick.py", "--only", "c4_60m,c4_step_60m", "--out", str(out),
                 "--launcher", launcher, *[f"--set={s[2:]}" for s in sets]]
    log = run([sys.executable] + grid_argv)
    return {"data": data, "out": out, "log": log, "argv": grid_argv}


@pytest.mark.slow
def test_the_grid_resumes_a_stopped_run_and_tables_the_perplexity(grid):
    out, log = grid["out"], grid["log"]
    assert re.search(r"c4_60m: resuming: .*torch\.distributed\.run --standalone --nproc_per_node=2 train\.py "
                     r"config/c4_60m\.py", log)
    assert re.search(r"c4_step_60m: starting: .* train\.py config/c4_step_60m\.py", log)
    table = (out / "table.md").read_text()
    for name in ("c4_60m", "c4_step_60m"):
        result = json.loads((out / name / "result.json").read_text())
        assert result["steps"] == 4 and result["peak_bytes"] is None and result["tokens_per_s"] > 0
        assert abs(result["ppl"] - math.exp(result["final_val"])) < 1e-9
        row = f"| {name} | 4 | {result['final_val']:.4f} | {result['ppl']:.2f} | 34.06 | n/a (no GPU) |"
        assert row in table
        records = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        evals = [r for r in records if "val_loss" in r]
        assert [r["step"] for r in evals] == [0, 2, 4]
        assert all(abs(r["val_ppl"] - math.exp(r["val_loss"])) < 1e-9 for r in evals)
    assert "resuming from" in (out / "c4_60m" / "train.log").read_text()
    assert "| APOLLO-Mini (lr 0.02) | 30.95 | 22.85 | 16.63 | 13.95 |" in table


@pytest.mark.slow
def test_the_grid_again_skips_finished_runs(grid, monkeypatch, capsys):
    from bench import yardstick
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a finished run started again"))
    yardstick.main(grid["argv"][1:])
    assert capsys.readouterr().out.strip().endswith((grid["out"] / "table.md").read_text().strip())


@pytest.mark.slow
def test_the_run_exports_samples_and_scores_with_its_tokenizer(grid, tmp_path, capsys):
    """`python export_hf.py out-c4-60m hf-c4-60m` writes the data folder's tokenizer; sample.py and
    downstream/val_docs.py read it from the data folder."""
    import export_hf
    import sample
    from downstream import val_docs
    from transformers import AutoTokenizer, LlamaForCausalLM
    run_dir, data = str(grid["out"] / "c4_60m"), str(grid["data"])
    assert ["python", "export_hf.py", "out-c4-60m", "hf-c4-60m"] in page_commands()
    export_hf.main([run_dir, str(tmp_path / "hf")])
    assert "tokenizer.json (hf:" in capsys.readouterr().out
    meta = json.loads(open(os.path.join(data, "meta.json")).read())
    ours, theirs = tokenizer_of(meta, data), AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = " ".join(documents(5, 3))
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    ids = (config["pad_token_id"], config["eos_token_id"])
    assert ids == (theirs.pad_token_id, theirs.eos_token_id) == (0, 1)
    from stepgpt.checkpoint import load_checkpoint
    model = GPT.from_checkpoint(load_checkpoint(run_dir)).eval()
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    data_arrays, _ = load_data(data, 32)
    x = torch.from_numpy(data_arrays["val"][:2].astype(np.int64))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x, x)[0], atol=1e-4, rtol=1e-4)
    sample.main(["--ckpt", run_dir, "--prompt", "the", "--max_new_tokens", "5"])
    assert capsys.readouterr().out.startswith("the")
    val_docs.main([data, "--ckpt", run_dir, "--out", str(tmp_path / "docs.jsonl")])
    printed = capsys.readouterr().out
    assert f"{len(data_arrays['val'])} documents" in printed and "bits per byte" in printed
