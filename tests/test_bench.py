"""The bench/ scripts run as their docstrings show (the quick ones in full, the long ones scaled down)."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import needs_interpreter, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv, timeout=300):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_merge_survival_table():
    rows = [line.split("|") for line in run("bench/merge.py").splitlines()[1:]]
    kept = {float(r[0]): (float(r[1].split()[0].rstrip("%")), float(r[2].split()[0].rstrip("%")))
            for r in rows}
    # nearest loses a tenth-step update; stochastic keeps it
    assert kept[0.1][0] < 5 and abs(kept[0.1][1] - 100) < 5
    assert abs(kept[20][0] - 100) < 1 and abs(kept[20][1] - 100) < 1


def test_reproduce_grid_runs_resumes_and_skips(tmp_path):
    """bench/reproduce.py as its docstring runs a part of the grid, scaled down in size: a table
    with a row per run, a finished run skipped the next time, an unfinished one resumed."""
    data = tmp_path / "data"
    write_dataset(str(data))
    out = tmp_path / "grid"
    small = ["--set", "n_embd=32", "--set", "n_head=2", "--set", "ffn_hidden=64", "--set", "block_size=16",
             "--set", "batch_size=2", "--set", "eval_iters=2", "--set", f"data_dir={data}",
             "--set", "log_interval=1"]
    argv = ["bench/reproduce.py", "--only", "vanilla-s1,step2-s1,relora", "--tokens", "1024", "--evals", "4",
            "--out", str(out), *small]
    first = run(*argv)
    rows = [line for line in (out / "table.md").read_text().splitlines()
            if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["vanilla-s1", "step2-s1", "relora"]
    assert "| 1,024 |" in rows[2] and "vanilla-s1: final val" in first
    assert "starting" in first and "resuming" not in first
    os.remove(out / "step2-s1" / "result.json")       # as if the grid had been stopped during that run
    again = run(*argv)
    assert ("step2-s1: resuming" in again and "vanilla-s1: starting" not in again
            and "relora: starting" not in again)
    proc = subprocess.run([sys.executable, *argv[:4], "2048", *argv[5:]], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "is from other settings" in proc.stderr


def test_memory_table(tmp_path):
    """bench/peak_memory.py as its docstring runs it, scaled down: a row per stage and phase, the
    planned peak beside the measured one, STEP's run peak below vanilla's."""
    write_dataset(str(tmp_path), vocab=8192)
    out = run("bench/peak_memory.py", "--only", "vanilla,step2", "--modes", "plain", "--set", "batch_size=1",
              "--set", f"data_dir={tmp_path}")
    rows = [r.split("|")[1:-1] for r in out.splitlines()
            if r.startswith("| vanilla") or r.startswith("| step2")]
    assert [r[2].strip() for r in rows] == ["1 stage change", "1 step", "1 stage change", "1 step",
                                            "2 stage change", "2 step"]
    for r in rows:
        if "step" == r[2].split()[-1]:
            planned, measured = float(r[5].replace(",", "")), float(r[6].replace(",", ""))
            assert abs(measured - planned) < 0.1 * planned
    assert rows[1][8].strip() == "1.00x" and float(rows[-1][8].strip().rstrip("x")) < 1
    # --config: another model's final depth in 3 planned stages (gpu_check.sh's 350M and 1B form)
    cfg = tmp_path / "c.py"
    cfg.write_text(f"data_dir = {str(tmp_path)!r}\nn_embd = 64\nn_head = 2\nstage_layers = [2, 2]\n"
                   f"block_size = 32\n")
    out = run("bench/peak_memory.py", "--config", str(cfg), "--only", "step3", "--modes", "ckpt",
              "--set", "batch_size=1")
    rows = [r.split("|")[1:-1] for r in out.splitlines() if r.startswith("| step3")]
    assert [r[2].strip() for r in rows] == [f"{s} {p}" for s in (1, 2, 3) for p in ("stage change", "step")]
    assert sum(int(r[3].split("+")[0]) for r in rows[1::2]) == 4


def test_meta_device_state_of_the_paper_scale_configs_is_the_plan():
    """bench/peak_memory.py --meta as its docstring runs it: at 350M, 1B and 7B, for AdamW and (where
    bitsandbytes is installed) 8-bit AdamW, every stage's model built on the meta device holds
    exactly the planned model state plus the RoPE tables, which the plan leaves out."""
    import importlib.util
    out = run("bench/peak_memory.py", "--meta", "config/step_350m.py,config/step_1b.py,config/step_7b.py")
    rows = [r.split("|")[1:-1] for r in out.splitlines() if r.startswith("| step_")]
    optimizers = ["adamw", "adamw8bit"] if importlib.util.find_spec("bitsandbytes") else ["adamw"]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (c, o, s) for c, stages in (("step_350m.py", "12"), ("step_1b.py", "123"), ("step_7b.py", "123"))
        for o in optimizers for s in ["vanilla", *stages]]
    for r in rows:   # 2 tables x positions x head size / 2 x 4 B: 1024 x 32 at 350M and 1B, 2048 x 64 at 7B
        rope = "1,048,576 B" if r[0].strip() == "step_7b.py" else "262,144 B"
        assert r[6].strip() == r[7].strip() == rope, r


def test_reproduce_at_350m_scale_through_torchrun(tmp_path):
    """The README's `--scale 350m --launcher "torchrun ..."` form: config/step_350m.py's keys and
    accumulation, 2 CPU ranks with gloo, the model scaled down."""
    write_dataset(str(tmp_path / "data"))
    small = [f"--set={kv}" for kv in ("n_embd=32", "n_head=2", "ffn_hidden=64", "block_size=16",
                                      "batch_size=2", "lora_rank=4", "vocab_size=0", "target_layers=2",
                                      "eval_iters=1", "warmup_iters=1", "stage_warmup_iters=1",
                                      f"data_dir={tmp_path / 'data'}")]
    launcher = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node=2"
    out = run("bench/reproduce.py", "--scale", "350m", "--only", "vanilla-s1,step2-s1", "--tokens", "2048",
              "--evals", "2", "--out", str(tmp_path / "grid"), "--launcher", launcher, *small)
    assert "torch.distributed.run" in out and "config/step_350m.py" in out
    rows = (tmp_path / "grid" / "table.md").read_text().splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["vanilla-s1", "step2-s1"]
    assert all("| 2,048 |" in r for r in rows)


def test_train_step_time_bench_as_the_readme_runs_it():
    """bench/step_time.py's two README forms, scaled down in depth, batch and length only."""
    import re
    small = run("bench/step_time.py", "--layers", "2", "--batch", "2", "--block", "16", "--windows", "2",
                "--steps", "1", "--warmup", "1")
    assert "| STEP, 1 of 2 frozen" in small and "| vanilla" in small
    ratio = re.search(r"STEP / vanilla step time: (\d+\.\d{3}) measured; "
                      r"(\d\.\d{3}) in training matmul FLOPs", small)
    assert ratio and 0 < float(ratio.group(2)) < 1
    wide = run("bench/step_time.py", "config/step_350m.py", "--layers", "2", "--batch", "1", "--block", "8",
               "--vocab", "256", "--windows", "1", "--steps", "1", "--warmup", "0")
    assert "n_embd 1024, ffn 2736, lora rank 64, vocab 256; batch 1 x 8 tokens" in wide


def test_gpu_check_smoke_runs_every_command(tmp_path):
    """bench/gpu_check.sh with SMOKE=1: each of its commands at tiny sizes on the CPU, so that a
    command that would fail on a lent GPU fails here first."""
    env = {**os.environ, "SMOKE": "1", "GPU_CHECK_OUT": str(tmp_path),   # its `python` is this one
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, env=env)
    log = (tmp_path / "gpu_check.log").read_text()
    steps = [line for line in log.splitlines() if line.startswith("=== ") and ": rc=" in line]
    assert len(steps) == 6 and all(": rc=0 " in line for line in steps), \
        "\n".join(steps) + proc.stderr[-2000:]
    assert proc.returncode == 0 and "all steps passed" in log


def test_train_bench_times_the_triton_path_as_train_py_runs_it(monkeypatch, capsys):
    """bench/step_time.py takes train.py's precision, TF32 and compile settings; with the interpreter
    standing in for the GPU, the frozen layers run the Triton kernels inside the timed steps (no
    warm-up: every step is timed)."""
    from bench import step_time
    from stepgpt import kernels
    needs_interpreter()
    monkeypatch.setenv("STEP_KERNELS", "triton")
    calls = []
    forward = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a: calls.append(a[0]) or forward(*a))
    step_time.main(["--layers", "2", "--batch", "2", "--block", "16", "--windows", "1", "--steps", "1",
                      "--warmup", "0", "--set", "device=cpu"])
    assert calls and set(calls) <= set(kernels.PATHS)
    assert "cpu, float32, torch" in capsys.readouterr().out


def test_step_time_table_is_written_after_each_window(tmp_path, monkeypatch, capsys):
    """bench/step_time.py --out: the table as a file, rewritten after each window, so a run stopped
    at a time limit leaves the windows it finished (here the third window's first step fails)."""
    from bench import step_time
    out = tmp_path / "step_time.md"
    argv = ["--layers", "2", "--batch", "2", "--block", "16", "--windows", "3", "--steps", "1",
            "--warmup", "0", "--out", str(out)]
    step_time.main(argv)
    printed = capsys.readouterr().out.splitlines()
    assert out.read_text().splitlines() == printed[:1] + [""] + printed[1:]
    calls = []
    real = step_time.step

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:   # 2 models x 2 windows done
            raise RuntimeError("killed")
        real(*args)

    monkeypatch.setattr(step_time, "step", failing)
    with pytest.raises(RuntimeError):
        step_time.main(argv)
    lines = out.read_text().splitlines()
    assert lines[1] == "(partial: 2 of 3 windows)" and lines[3].startswith("| model")
    assert lines[-1].startswith("STEP / vanilla step time: ")


def test_kernel_table_is_written_after_each_shape(tmp_path, monkeypatch):
    """bench/kernels.py --out rewrites its markdown after each layer shape (a run killed at a time
    limit leaves the shapes it finished), marked partial until the last; the targets at the end.
    The GPU measurement is replaced by fixed rows: only the writing is checked here."""
    from bench import kernels as bench
    out = tmp_path / "kernels.md"
    seen = []

    def fake(model, layer, n, k, m, r, paths, reverse):
        seen.append(out.read_text() if out.exists() else "")
        t = (1.0, 0.9, 1.1)
        return [dict(model=model, layer=layer, n=n, k=k, m=m, r=r, provider=name, configs="", fwd=t, bwd=t,
                     full=t, tflops_fwd=1.0, tflops_full=1.0, peak=1.0)
                for name in ("step:fused*", "step:hybrid", "reference", "bf16 frozen", "bf16 trained")]

    monkeypatch.setattr(bench, "bench_config", fake)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    bench.run_gpu(argparse.Namespace(quick=True, out=str(out)))
    assert seen[0] == "" and "**Partial: 1 of 6 configurations measured.**" in seen[1]
    assert seen[1].count("| 350M | q/k/v/o |") == 5 and "| gate/up |" not in seen[1]
    final = out.read_text()
    assert "Partial" not in final and final.count("| 1B | down |") == 5
    assert "- FAIL  1B down step:fused* f+b time / bf16 frozen: 1.00x (goal <= 1.10)" not in final
    assert "- PASS  1B down step:fused* f+b time / bf16 frozen: 1.00x (goal <= 1.10)" in final
