"""A checkpoint is data, never code (stepgpt/safeload.py): files built as an attacker would (a pickled
object whose unpickling writes a marker file, the header, checksum and MANIFEST.json made to match) in
each place a checkpoint holds a pickle: a .pt file, a .dcp folder's header.pt, its .metadata, and an
entry its metadata declares as pickled bytes. Every command that opens a checkpoint refuses each in one
line naming the file and what it asked for, before any work, and the marker never appears; our own
files, new and as earlier versions wrote them, load and resume as before. In-process, one tiny run
shared by all; the FSDP resume of such folders is in tests/test_fsdp.py's spawn."""
import glob
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import export_hf
import grow
import sample
import train
from downstream import compare, val_docs
from stepgpt import safeload, sharding
from stepgpt.checkpoint import (DIGEST_HEX, HEADER, MAGIC, MANIFEST, _file_digest, _write_file,
                                checkpoint_files, load_checkpoint)
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import ASKED, CRAFT, HANG, REFUSED_FILE, Payload, write_dataset
from tools import dcp_to_file, digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4",
       "--lora_rank=4", "--eval_iters=2", "--log_interval=2", "--sample_tokens=0", "--warmup_iters=2",
       "--stage_warmup_iters=1", "--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4"]


def as_folder(path, folder):
    """The .pt checkpoint `path` written as a .dcp folder, laid out as an FSDP run writes one
    (checkpoint._save_folder): DCP's files of the tensors, header.pt, MANIFEST.json."""
    ckpt = load_checkpoint(path)
    opt = ckpt["optimizer"]
    state = {"model": ckpt["model"], "optimizer": opt["state"]}
    layout = {i: {k: sharding.spec(v) if torch.is_tensor(v) else v for k, v in s.items()}
              for i, s in opt["state"].items()}
    header = {**ckpt, "model": {k: sharding.spec(v) for k, v in ckpt["model"].items()},
              "optimizer": {**opt, "state": layout}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    _write_file(os.path.join(folder, HEADER), header)
    files = {n: [os.path.getsize(os.path.join(folder, n)), _file_digest(os.path.join(folder, n))]
             for n in sorted(os.listdir(folder))}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files}, f)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny 2-stage run stopped at step 8 of 12 (data of a real 300-token tokenizer, for sample.py),
    and its newest checkpoint as a folder too."""
    tmp = tmp_path_factory.mktemp("safeload")
    data = write_dataset(tmp / "data", vocab=300)
    train.main(RUN + [f"--data_dir={data}", f"--out_dir={tmp / 'run'}", "--stop_at=8"])
    newest = checkpoint_files(str(tmp / "run"))[0]
    assert newest.endswith("ckpt-00000008.pt")
    as_folder(newest, str(tmp / "folder.dcp"))
    return tmp, data


@pytest.fixture(scope="module")
def crafted(run):
    """{kind: the crafted checkpoint (a file, or a folder)}, each with its own marker beside it."""
    tmp, _ = run
    paths = {}
    for kind, craft in CRAFT.items():
        if kind == "file":
            paths[kind] = str(tmp / "crafted.pt")
            shutil.copy(checkpoint_files(str(tmp / "run"))[0], paths[kind])
        else:
            paths[kind] = str(tmp / f"crafted-{kind}.dcp")
            shutil.copytree(tmp / "folder.dcp", paths[kind])
        craft(paths[kind], tmp / f"marker-{kind}")
    return paths


def marker(run, kind):
    return run[0] / f"marker-{kind}"


def test_the_crafted_files_run_their_code_when_read_as_torch_and_dcp_read_them(run, crafted):
    """The control: each crafted file is live. torch.load(weights_only=False) of a .pt file or a header,
    DCP's FileSystemReader's pickle.load of .metadata, DCP's planner reading a bytes entry: each runs
    the file's code (it writes the marker); the project's own reader runs none of it."""
    for kind, path in crafted.items():
        mark = marker(run, kind)
        assert not mark.exists()
        if kind in ("file", "header"):
            with open(path if kind == "file" else os.path.join(path, HEADER), "rb") as f:
                f.seek(len(MAGIC) + DIGEST_HEX + 1)
                torch.load(f, weights_only=False)
        elif kind == "metadata":
            with open(os.path.join(path, ".metadata"), "rb") as f:
                pickle.load(f)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load({"model": {"wte.weight": torch.empty(0)}}, checkpoint_id=path, no_dist=True)
        assert mark.read_text() == "ran", kind
        mark.unlink()


def _sample(target, tmp, data):
    sample.main([f"--ckpt={target}", "--max_new_tokens=5", "--device=cpu"])


def _export(target, tmp, data):
    export_hf.main([target, str(tmp / "hf")])


def _grow(target, tmp, data):
    grow.main([target, "--add=1", f"--out={tmp / 'grown.pt'}"])


def _digest(target, tmp, data):
    digest.main([target])


def _dcp_to_file(target, tmp, data):
    dcp_to_file.main([target, f"--out={tmp / 'one.pt'}"])


def _val_docs(target, tmp, data):
    val_docs.main([data, f"--out={tmp / 'val.jsonl'}", f"--ckpt={target}"])


def _compare(target, tmp, data):
    pytest.importorskip("matplotlib")   # compare.py needs it before it reads a checkpoint
    compare.main([target, target, f"--out={tmp / 'downstream'}"])


def _init_from(target, tmp, data):
    train.main(RUN + [f"--data_dir={data}", f"--out_dir={tmp / 'out'}", f"--init_from={target}"])


ENTRIES = {"sample.py": _sample, "export_hf.py": _export, "grow.py": _grow, "tools/digest.py": _digest,
           "downstream/val_docs.py": _val_docs, "downstream/compare.py": _compare,
           "train.py --init_from=FILE": _init_from, "tools/dcp_to_file.py": _dcp_to_file}
FOLDERS_ONLY = {"tools/dcp_to_file.py"}   # a .pt file is one file already: refused before it is read


def refusal(run, kind, path, call):
    """call() refused in one line naming the crafted file `path` and what it asked for; its code not
    run. -> the line."""
    with pytest.raises(UserError) as e:
        call()
    line = str(e.value)
    assert "\n" not in line, line
    assert line.startswith(f"checkpoint {path}{REFUSED_FILE[kind]} {ASKED[kind]}: "), line
    assert not marker(run, kind).exists()
    return line


@pytest.mark.parametrize("entry,kind", [(e, k) for e in ENTRIES for k in CRAFT
                                         if not (e in FOLDERS_ONLY and k == "file")])
def test_every_command_that_opens_a_checkpoint_refuses_a_crafted_one_in_one_line(run, crafted, kind, entry,
                                                                                 tmp_path):
    """sample.py, export_hf.py, grow.py, tools/digest.py, tools/dcp_to_file.py (folders), the
    downstream readers and train.py --init_from=FILE on each crafted file: one line, the marker never
    written, and nothing written by the command (train.py's run.lock aside: it takes out_dir before
    it reads)."""
    refusal(run, kind, crafted[kind], lambda: ENTRIES[entry](crafted[kind], tmp_path, run[1]))
    written = [os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "**"), recursive=True)]
    assert sorted(written) in ([".", "out", os.path.join("out", "run.lock")], ["."]), written


def _snapshot(folder):
    """Every file of a folder and its bytes (run.lock's: its holder, rewritten by each run that takes it)."""
    return {os.path.relpath(p, folder): None if p.endswith("run.lock") else open(p, "rb").read()
            for p in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(p)}


@pytest.mark.parametrize("kind", CRAFT)
def test_a_resume_whose_newest_checkpoint_is_crafted_is_refused_with_no_fall_back(run, crafted, kind,
                                                                                  tmp_path):
    """The crafted file as the newest checkpoint of a run folder: --init_from=resume (and sample.py
    on the folder) refuse it in one line, never taking the one before it; the folder is as it was."""
    tmp, data = run
    out = tmp_path / "run"
    shutil.copytree(tmp / "run", out)
    newest = checkpoint_files(str(out))[0]
    os.remove(newest)
    target = newest if kind == "file" else newest[:-3] + ".dcp"
    (shutil.copy if kind == "file" else shutil.copytree)(crafted[kind], target)
    before = _snapshot(out)
    refusal(run, kind, target, lambda: train.main(RUN + [f"--data_dir={data}", f"--out_dir={out}",
                                                         "--init_from=resume"]))
    refusal(run, kind, target, lambda: sample.main([f"--ckpt={out}", "--device=cpu"]))
    assert _snapshot(out) == before


def test_a_checkpoint_written_the_old_way_loads_and_resumes_as_the_new_one(run, tmp_path):
    """Today's dict with the RNG state as the versions up to 0458d0f kept it (numpy's array), through
    torch.save: the numpy names of safeload.OLD_FILES are what it needs beyond torch's own, and a new
    file needs none; resumed, it ends bit for bit where the new file's resume ends."""
    tmp, data = run
    new, old = tmp_path / "new", tmp_path / "old"
    for out in (new, old):
        shutil.copytree(tmp / "run", out)
    path = checkpoint_files(str(old))[0]
    ckpt = load_checkpoint(path)
    name, keys, *rest = ckpt["rng"]["numpy"]
    assert torch.is_tensor(keys) and keys.dtype == torch.int64
    ckpt["rng"]["numpy"] = (name, keys.numpy().astype(np.uint32), *rest)   # np.random.get_state()'s tuple
    _write_file(path, ckpt)

    def asks(file):   # the globals beyond torch's own that the file names
        with open(file, "rb") as f:
            f.seek(len(MAGIC) + DIGEST_HEX + 1)
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    assert asks(path) == ["numpy._core.multiarray._reconstruct", "numpy.dtype", "numpy.ndarray"]
    assert asks(checkpoint_files(str(new))[0]) == []
    for out in (new, old):
        train.main(RUN + [f"--data_dir={data}", f"--out_dir={out}", "--init_from=resume"])
    a, b = load_checkpoint(str(new)), load_checkpoint(str(old))
    assert a["iter_num"] == b["iter_num"] == 12
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k])
                                                          for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_our_folder_reads_whole_as_the_file_it_was_made_from(run):
    tmp, _ = run
    a, b = load_checkpoint(checkpoint_files(str(tmp / "run"))[0]), load_checkpoint(str(tmp / "folder.dcp"))
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k])
                                                          for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_dcp_metadata_names_only_what_the_reader_admits(tmp_path):
    """What DCP's .metadata of this torch names (every dtype and kind of entry our folders hold, and
    a bytes entry) is within safeload.METADATA_GLOBALS, and read through MetadataReader it equals
    DCP's own reading. A torch that pickles other classes there fails here, naming them: check that
    each is data, then admit it."""
    state = {"model": {f"w{i}": torch.ones(3, 2, dtype=dtype) for i, dtype in
                       enumerate((torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64))},
             "optimizer": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5)}}, "extra": {"a": 1}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    names = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)
    with open(tmp_path / ".metadata", "rb") as f:
        theirs = Recording(f).load()
    assert not names - set(safeload.METADATA_GLOBALS), names - set(safeload.METADATA_GLOBALS)
    ours = safeload.MetadataReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    for (module, name), obj in safeload.METADATA_GLOBALS.items():   # each still where DCP pickles it from
        if module.startswith("torch.distributed"):
            assert getattr(sys.modules[module], name) is obj, (module, name)


def test_a_damaged_or_foreign_metadata_is_one_line(run, tmp_path):
    tmp, _ = run
    folder = str(tmp_path / "f.dcp")
    shutil.copytree(tmp / "folder.dcp", folder)
    for content, why in ((b"not a pickle", "is not DCP metadata"),
                         (pickle.dumps({"a": 1}), "is not DCP metadata (it holds a dict)")):
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            f.write(content)
        with pytest.raises(UserError, match="^" + re.escape(f"checkpoint {folder}/.metadata {why}")):
            safeload.read_metadata(os.path.join(folder, ".metadata"))


def test_a_file_that_torch_s_reader_stops_at_is_refused_naming_why(tmp_path):
    """A pickle of another protocol than torch.save's, and a torch.save of the old (not zip) layout:
    refused naming what the reader stopped at, the marker not written."""
    for kw in ({"pickle_protocol": 4}, {"_use_new_zipfile_serialization": False}):
        blob = io.BytesIO()
        torch.save({"model": {}, "x": Payload(tmp_path / "marker")}, blob, **kw)
        blob.seek(0)
        with pytest.raises(UserError, match=r"^checkpoint F holds what a reader of data refuses \(\w"):
            safeload.load(blob, "F")
    assert not (tmp_path / "marker").exists()


def test_the_other_doors_hold(tmp_path):
    """No product code unpickles a file or passes trust_remote_code: torch.load, dcp.load and DCP's
    reader appear in stepgpt/safeload.py alone (DCP's format_utils, which reads with a plain one,
    nowhere). A command-line override is a literal or a string,
    never code. A Hugging Face folder with a pickle for its weights is refused; its code not run."""
    product = [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
               if not os.path.relpath(p, ROOT).startswith(("tests", ".")) and "site-packages" not in p]
    assert len(product) > 20
    for path in product:
        text = open(path, encoding="utf-8").read()
        for word in ("weights_only=False", "pickle.load", "trust_remote_code", "allow_pickle", "marshal.load",
                     "shelve.open"):
            assert word not in text, (path, word)
        if not path.endswith(os.path.join("stepgpt", "safeload.py")):   # DCP's format_utils: a plain reader
            for word in ("torch.load(", "dcp.load(", "FileSystemReader(", "format_utils"):
                assert word not in text, (path, word)
    mark = tmp_path / "marker"
    cfg = load_config([f"--wandb_run_name=__import__('os').system('touch {mark}')"])
    assert cfg.wandb_run_name.startswith("__import__(") and not mark.exists()
    with pytest.raises(UserError, match="config key 'seed' wants a int"):
        load_config([f"--seed=exec('open({str(mark)!r}, \"w\")')"])
    assert not mark.exists()
    pytest.importorskip("safetensors")
    from stepgpt import hf
    folder = tmp_path / "hf"
    os.makedirs(folder)
    with open(folder / "config.json", "w") as f:
        json.dump({k: 32 for k in hf.CONFIG_INTS}, f)
    torch.save({"model.embed_tokens.weight": Payload(mark)}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match="has no model.safetensors"):
        hf.read_hf(str(folder))
    assert not mark.exists()


@pytest.mark.slow
def test_the_scripts_refuse_a_crafted_checkpoint_in_one_line_with_no_traceback(run, crafted, tmp_path):
    """As a user sees it: sample.py on a crafted file, train.py resuming a run folder whose newest is a
    folder with a crafted .metadata: exit status 2, one line on stderr, the marker never written."""
    tmp, data = run
    out = tmp_path / "run"
    shutil.copytree(tmp / "run", out)
    os.remove(checkpoint_files(str(out))[0])
    shutil.copytree(crafted["metadata"], out / "ckpt-00000008.dcp")
    for kind, argv in (("file", ["sample.py", f"--ckpt={crafted['file']}"]),
                       ("metadata", ["train.py", *RUN, f"--data_dir={data}", f"--out_dir={out}",
                                     "--init_from=resume"])):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=HANG)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert proc.stderr.startswith("error: checkpoint ") and ASKED[kind] in proc.stderr, proc.stderr
        assert not marker(run, kind).exists()
