"""The machines a learner has besides a Linux box with triton (the install page): a Mac or a Windows
box, where PyPI has no triton and worker processes start by spawn, and Apple's MPS. We have neither
here: these tests stand in for them (triton made unimportable, spawn forced, the device checks
stubbed), and the install page says what that does and does not show."""
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data import prepare as prep
from stepgpt import checkpoint, monitor, runtime
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import HANG, without_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4",
        "--eval_iters=2", "--log_interval=2", "--sample_tokens=0", "--warmup_iters=4",
        "--stage_warmup_iters=3"]
TEXT = ("ROMEO:\nBut, soft! what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\nJULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"
        "Deny thy father and refuse thy name.\n")


def run(env, *argv):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_the_readmes_commands_run_where_triton_cannot_be_imported(tmp_path):
    """As on a Mac or a Windows box (no triton; processes start by spawn), scaled down: data/prepare.py
    in two worker processes, the main job (config/step_small.py, device=auto) through its stage
    boundary and a checkpoint, stopped, then resumed to its end; sample.py, plan.py and export_hf.py
    on the result; bench/kernels.py says in one line that it needs triton."""
    env = without_triton(tmp_path / "site")
    code, out, err = run(env, "-c", "import importlib.util, multiprocessing; print(importlib.util.find_spec("
                         "'triton'), multiprocessing.get_start_method())")
    assert (code, out) == (0, "None spawn\n"), err
    texts, data = tmp_path / "texts", tmp_path / "data"
    texts.mkdir()
    for i in range(8):
        (texts / f"{i}.txt").write_text(TEXT * (20 + i))
    code, out, err = run(env, "data/prepare.py", f"--source={texts}", f"--out={data}", "--vocab_ranks=512",
                         "--workers=2")
    assert code == 0 and "in 2 processes" in out, err[-2000:]

    out_dir = tmp_path / "out"
    job = ["train.py", "config/step_small.py", *TINY, f"--data_dir={data}", f"--out_dir={out_dir}",
           "--stage_layers=[1, 1]", "--stage_tokens=[256, 256]", "--eval_interval=2"]   # 4 + 4 steps
    code, out, err = run(env, *job, "--stop_at=6")
    assert code == 0, err[-2000:]
    assert "kernels : pytorch reference" in out and "device : cpu (cpu)" in out
    assert "== stage 2/2" in out and "ckpt saved" in out
    code, out, err = run(env, *job, "--init_from=resume")
    assert code == 0 and "resuming from" in out and "(step 6)" in out, err[-2000:]
    assert "done: 8 iters" in out
    assert checkpoint.load_checkpoint(str(out_dir))["iter_num"] == 8

    code, out, err = run(env, "sample.py", f"--ckpt={out_dir}", "--max_new_tokens=8", "--prompt=ROMEO:")
    assert code == 0 and out.startswith("ROMEO:"), err[-2000:]
    code, out, err = run(env, "plan.py", "config/step_small.py")
    assert code == 0 and "[3, 3]" in out, err[-2000:]
    code, out, err = run(env, "bench/kernels.py")
    assert code == 1 and out.strip().splitlines() == [
        "bench/kernels.py needs triton, which PyPI has for Linux only (pip install -r requirements.txt "
        "there); without it every frozen linear runs the plain-PyTorch reference"], err[-2000:]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return   # export_hf.py needs it (requirements-test.txt); test_export.py skips likewise
    code, out, err = run(env, "export_hf.py", str(out_dir), str(tmp_path / "hf"))
    assert code == 0 and os.path.isfile(tmp_path / "hf" / "config.json"), err[-2000:]


def test_prepare_in_worker_processes_started_by_spawn_writes_the_tokens_fork_does(tmp_path, monkeypatch):
    """macOS and Windows start processes by spawn (a fresh interpreter that imports what it runs, and
    the tokenizer pickled to it): the same files as fork's, Linux's default."""
    monkeypatch.setattr(prep, "CHUNK_CHARS", 500)   # many tasks over the two workers
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(6):
        (texts / f"{i}.txt").write_text(TEXT * (3 + i))
    files = {}
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        for method in ("fork", "spawn"):
            multiprocessing.set_start_method(method, force=True)
            meta = prep.prepare(str(texts), str(tmp_path / method), vocab_ranks=512, workers=2)
            files[method] = [np.fromfile(tmp_path / method / f"{split}.bin", dtype=meta["dtype"]).tolist()
                             for split in ("train", "val")]
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert files["spawn"] == files["fork"] and len(files["fork"][0]) > 500
    meta = prep.prepare(str(texts), str(tmp_path / "one"), vocab_ranks=512, workers=1)   # and one process's
    assert np.fromfile(tmp_path / "one" / "train.bin", dtype=meta["dtype"]).tolist() == files["fork"][0]


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda:1"), (False, True, "mps"),
                                                 (False, False, "cpu")])
def test_device_auto_picks_cuda_then_mps_then_the_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert runtime.pick_device("auto", 1, ddp=False) == expected
    assert runtime.pick_device("cpu", 1, ddp=False) == "cpu"


def test_a_device_this_machine_lacks_is_one_line():
    if not torch.backends.mps.is_available():
        with pytest.raises(UserError, match=r"^device=mps but MPS is not available .*use --device=cpu$"):
            runtime.pick_device("mps", 0, ddp=False)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"^device=cuda but CUDA is not available; use --device=cpu$"):
            runtime.pick_device("cuda", 0, ddp=False)
    with pytest.raises(UserError, match=r"^device='tpu': use auto, cpu, cuda, cuda:N or mps$"):
        runtime.pick_device("tpu", 0, ddp=False)
    import sample   # its --device goes through the same rule, before the checkpoint is read
    with pytest.raises(UserError, match=r"^device='tpu'"):
        sample.main(["--ckpt=no-such-run", "--device=tpu"])


def test_on_mps_the_run_is_float32_and_eager(tmp_path):
    """The plain-PyTorch path on MPS, as nanoGPT's: fp32 unless asked for bf16 autocast, never
    compiled (compile_cpu does not reach it)."""
    cfg = load_config(TINY + [f"--out_dir={tmp_path}", "--compile_cpu=True"])
    dtype, autocast, compiled = runtime.precision(cfg, torch.device("mps"))
    assert (dtype, compiled) == ("float32", False)


def test_cpu_compilation_without_a_cpp_compiler_falls_back_to_eager_in_one_line(tmp_path, monkeypatch,
                                                                                 capsys):
    """inductor's own compiler search (g++, clang++, $CXX) finding nothing: one line, then eager."""
    from torch._inductor import config as inductor_config
    cfg = load_config(TINY + [f"--out_dir={tmp_path}", "--compile_cpu=True"])
    if runtime.has_cpp_compiler():
        assert runtime.precision(cfg, torch.device("cpu"))[2] is True
        assert capsys.readouterr().out == ""
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))
    assert not runtime.has_cpp_compiler()
    assert runtime.precision(cfg, torch.device("cpu"))[2] is False
    assert capsys.readouterr().out.splitlines() == [
        "compile_cpu=True: torch.compile needs a C++ compiler on the CPU (g++, clang++ or $CXX; MSVC on "
        "Windows) and none was found; training eager"]


def test_without_proc_meminfo_the_memory_line_names_the_machines_ram(monkeypatch):
    """macOS and Windows have no /proc/meminfo (nor os.sysconf's SC_AVPHYS_PAGES): the line that an
    out-of-memory error ends with names the RAM without a number instead of failing."""
    assert monitor.ram_available() > 0   # here, Linux

    def no_such_file(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", path)
    monkeypatch.setattr(monitor, "open", no_such_file, raising=False)   # monitor's own open() only
    assert monitor.ram_available() is None
    assert monitor.device_memory(torch.device("cpu")).startswith("the machine's RAM")


def test_on_windows_a_checkpoint_folder_is_not_opened_to_fsync_it(tmp_path, monkeypatch):
    """Windows cannot open a folder (os.open raises PermissionError there): the rename is left to NTFS."""
    def no_folders(path, flags, *args):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(os, "open", no_folders)
    with pytest.raises(PermissionError):
        checkpoint._fsync_dir(str(tmp_path))
    monkeypatch.setattr(os, "name", "nt")
    checkpoint._fsync_dir(str(tmp_path))
