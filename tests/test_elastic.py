"""A run no one has to watch, under torchrun on CPU ranks (gloo): docs/distributed.md's elastic
command with a worker killed (torchrun restarts the ranks, the run ends with the uninterrupted
run's tensors, bit for bit); its Slurm script (srun and scontrol stubbed) with its lock holder
killed, the whole job killed, then pre-empted ahead of its time limit and requeued, each time the
same command; and one run carried over 2 and 3 ranks, FSDP and DDP, through kill -9 and SIGTERM at
every phase of a sharded checkpoint's write, a full disk and a hung rank, ending at one process's
val losses. Faults are injected from outside the product: a wrapper around train.py (FAULTS) kills,
stops or signals a rank at a named point."""
import glob
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from stepgpt.checkpoint import load_checkpoint
from stepgpt.runtime import ROLL_CALL
from tests.helpers import HANG, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "distributed.md")
# config/step_350m.py scaled down in size only: 2 x 16 tokens x 6 micro-steps = 192 tokens a step
# (6 micro-steps and 6 eval batches divide over 1, 2 and 3 ranks), 6 steps in stage 1, the growth at
# step 6, 10 in stage 2 with ReLoRA restarts at 8, 10, 12 and 14
# fp32: the equalities below are fp32's; dtype=auto would pick bf16 autocast on a CPU that computes bf16
# natively, whose rounding differs with each rank's share (tests/test_gpu_decisions.py holds bf16 to fp32)
SIZE = ["--vocab_size=0", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--lora_rank=4",
        "--lora_alpha=8.0", "--target_layers=2", "--batch_size=2", "--gradient_accumulation_steps=6",
        "--stage_tokens=[1152, 1920]", "--warmup_iters=2", "--stage_warmup_iters=2", "--relora_every=2",
        "--eval_iters=6", "--log_interval=1", "--sample_tokens=0", "--dtype=float32"]

# train.py with faults, each {"attempt": torchrun's restart count, "victim": rank, "signal": SIGKILL |
# SIGTERM | SIGSTOP | FSIZE (a file size limit of 64 KiB, under the checkpoint's and its shards',
# over the logs': the checkpoint's write fails as on a full disk), "at": where,
# "step": the step}. At "step": as the victim starts that training step; at "eval", that step's
# eval. At "shards": as the victim's own files of that step's .dcp folder are written; at "fsize",
# as that step's checkpoint is about to be written. At "manifest", "rename", "rotation": rank 0
# signals the victim once it has written the folder's manifest, renamed the folder, or renamed an
# old one away and deleted a file of it. At "hold" (every rank): after the log line of that step,
# until a SIGTERM (a pre-emption) arrives.
# Each rank writes its pid to FAULT_DIR/pid-A-R, and FAULT_DIR/held-A-R when it holds.
FAULTS = f"""
import json, os, resource, shutil, signal, sys, time
sys.path.insert(0, {ROOT!r})
import torch.distributed.checkpoint as dcp
import train
from stepgpt import checkpoint, errors, monitor, runtime

attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ.get("RANK", 0))
folder = os.environ["FAULT_DIR"]
with open(os.path.join(folder, f"pid-{{attempt}}-{{rank}}"), "w") as f:
    f.write(str(os.getpid()))
faults = [f for f in json.loads(os.environ.get("FAULTS", "[]")) if f.get("attempt", 0) == attempt]
saving, signalled, step = [None], [], [0]


def strike(at, step):
    for f in faults:
        if f["at"] == at and f["step"] == step and rank == (0 if at in ("manifest", "rename", "rotation")
                                                             else f["victim"]):
            if f["signal"] == "FSIZE":
                resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
                continue
            pid = os.path.join(folder, f"pid-{{attempt}}-{{f['victim']}}")
            while not os.path.exists(pid):
                time.sleep(0.01)
            os.kill(int(open(pid).read()), getattr(signal, f["signal"]))


def wrap(owner, name, before=None, after=None):
    real = getattr(owner, name)
    def wrapped(*a, **k):
        if before:
            before(*a, **k)
        out = real(*a, **k)
        if after:
            after(*a, **k)
        return out
    setattr(owner, name, wrapped)


def saved(run, model, opt, it, *a, **k):
    saving[0] = it
    strike("fsize", it)


def hold(log, *a, **k):
    for f in faults:
        if f["at"] == "hold" and str(a[0]).startswith(f"step {{f['step']:>6}}/"):
            open(os.path.join(folder, f"held-{{attempt}}-{{rank}}"), "w").close()
            while not signalled:
                time.sleep(0.01)


def rotating(path, *a, **k):
    if saving[0] is not None and path.endswith(".dcp.tmp") and os.path.isdir(path):
        if any(f["at"] == "rotation" and f["step"] == saving[0] for f in faults):
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
        strike("rotation", saving[0])


wrap(train, "train_step", before=lambda run, model, raw, opt, it: strike("step", it),
     after=lambda run, model, raw, opt, it: step.__setitem__(0, it + 1))
wrap(train, "estimate_loss", before=lambda *a: strike("eval", step[0]))
wrap(checkpoint, "save", before=saved)
wrap(dcp, "save", after=lambda *a, **k: strike("shards", saving[0]))
wrap(checkpoint, "_fsync_dir",
     after=lambda path: strike("manifest" if path.endswith(".dcp.tmp") else "rename", saving[0]))
wrap(shutil, "rmtree", before=rotating)
wrap(monitor.Logger, "print", after=hold)
wrap(runtime.StopRequest, "handle", after=lambda *a: signalled.append(1))
errors.run_cli(train.main)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wrapper(tmp):
    path = tmp / "faults.py"
    path.write_text(FAULTS)
    return str(path)


def start(cmd, tmp, name, faults=(), env=None):
    """cmd (its stdout and stderr into tmp/NAME.out and .err), FAULTS set; -> (process, FAULT_DIR)."""
    folder = tmp / f"faults-{name}"
    folder.mkdir()
    env = {**os.environ, **(env or {}), "FAULT_DIR": str(folder), "FAULTS": json.dumps(list(faults))}
    with open(tmp / f"{name}.out", "w") as out, open(tmp / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env, text=True), folder


def finish(proc, tmp, name, rc=0):
    proc.wait(timeout=HANG)
    out, err = (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text()
    assert proc.returncode == rc, out[-2000:] + err[-4000:]
    return out, err


def run(cmd, tmp, name, faults=(), rc=0, env=None):
    return finish(start(cmd, tmp, name, faults, env)[0], tmp, name, rc)


def torchrun(nproc, script, *args, restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", script, "config/step_350m.py", *SIZE, *args]


def wait_for(path_or_test, what):
    deadline = time.monotonic() + HANG
    while not (path_or_test() if callable(path_or_test) else os.path.exists(path_or_test)):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def same_final_state(a, b):
    """Two runs ended bit for bit alike: every weight and AdamW moment."""
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert ca["iter_num"] == cb["iter_num"] == 16 and ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def each_step_once(out, evals):
    """metrics.jsonl holds each training step's record and each eval's once, in order."""
    recs = records(out)
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 17))
    assert [r["step"] for r in recs if "val_loss" in r] == evals


def resumed_from(log):
    """The steps each attempt's first line says it resumed from."""
    pattern = r"^init_from=auto: .* holds this run: resuming from \S+ \(step (\d+)\)$"
    return [int(s) for s in re.findall(pattern, log, re.M)]


def gone_lines(err):
    return [line for line in err.splitlines() if re.match(r"error: rank \d+: rank", line)]


def gone(rank, victim, newest, timeout=300):
    """The line of a rank whose collective failed because `victim` is gone."""
    return (f"error: rank {rank}: rank {victim} is gone (no answer to a roll call within {ROLL_CALL} s: "
            f"killed, its node lost, or hung past dist_timeout={timeout} s); the newest checkpoint is "
            f"{newest}: a restart (torchrun --max-restarts, a requeue, or the same command again) continues "
            f"from it")


def docs_elastic_command():
    """docs/distributed.md's torchrun command with --max-restarts, as an argument list."""
    (line,) = [c for c in re.findall(r"^(torchrun .*--max-restarts.*)$", open(DOCS).read(), re.M)]
    return shlex.split(line, comments=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The docs' elastic command on 2 ranks, scaled down, with no fault: the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("elastic")
    data = write_dataset(tmp / "data")
    command = docs_elastic_command()
    assert command[:5] == ["torchrun", "--standalone", "--nproc_per_node=8", "--max-restarts=3", "train.py"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *command[3:],
           *SIZE, f"--data_dir={data}", "--eval_interval=2", f"--out_dir={tmp / 'straight'}"]
    run(cmd, tmp, "straight")
    return tmp, data, cmd


def test_the_docs_elastic_command_finishes_on_its_own_after_a_worker_is_killed(straight):
    """kill -9 of rank 1 in the eval of step 4, after the first checkpoint (step 2): rank 0 says in
    one line that rank 1 is gone and names that checkpoint (no traceback); torchrun restarts both
    ranks with the same command, which continues from it; the job exits 0 with every weight and
    AdamW moment of the uninterrupted run, and each step recorded once."""
    tmp, data, cmd = straight
    out = tmp / "killed"
    cmd = [wrapper(tmp) if a == "train.py" else a for a in cmd[:-1]] + [f"--out_dir={out}"]
    log, err = run(cmd, tmp, "killed", [dict(attempt=0, victim=1, signal="SIGKILL", at="eval", step=4)])
    assert gone_lines(err) == [gone(0, 1, f"{out}/ckpt-00000002.pt")], err[-3000:]
    assert "Traceback" not in err
    assert log.startswith(f"init_from=auto: out_dir={str(out)!r} holds no checkpoint: starting the run from "
                          f"scratch\n") and resumed_from(log) == [2]
    same_final_state(out, tmp / "straight")
    each_step_once(out, list(range(0, 17, 2)))


def slurm_script():
    """docs/distributed.md's batch script (the ```sh block after "Save it as `step.sbatch`")."""
    text = open(DOCS).read().split("Save it as `step.sbatch`", 1)[1]
    return text.split("```sh\n", 1)[1].split("```", 1)[0]


STUBS = {   # Slurm's commands on one machine, as they behave for the script
    "srun": 'exec "$@"\n',   # one task: the node's torchrun
    "scontrol": 'case "$1" in show) echo 127.0.0.1 ;; requeue) echo "$2" >> "$REQUEUED" ;; esac\n',
    "torchrun": f'exec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n',
}


def test_the_slurm_script_runs_through_a_killed_rank_a_lost_node_and_a_requeue_to_the_uninterrupted_end(
        straight, tmp_path):
    """The page's batch script run by bash as Slurm runs it (its environment; srun, scontrol and
    torchrun stubbed; 2 ranks on one node), three times, as a requeue would: first rank 0, which holds
    out_dir's lock, is killed in step 3 (torchrun restarts the ranks), then the whole job at step 6 (a
    node lost: --requeue runs the script again); the second is pre-empted ahead of its time limit
    (USR1 to the script at step 10: the ranks finish the step, save and exit, the script requeues the
    job); the third ends the run. Each run continues the last; the end is the uninterrupted run's,
    bit for bit, and metrics.jsonl and TensorBoard hold each step once."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard==2.21.0 (requirements-test.txt)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, data, _ = straight
    script = slurm_script()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@" in script
    assert "srun torchrun" in script and "--max-restarts=" in script
    script = script.replace("--nproc_per_node=8", "--nproc_per_node=2").replace(":29500", f":{_free_port()}")
    (tmp_path / "step.sbatch").write_text(script.replace(" train.py ", f" {wrapper(tmp_path)} "))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text("#!/bin/sh\n" + body)
        (stubs / name).chmod(stat.S_IRWXU)
    out, tb = tmp_path / "out", tmp_path / "tb"
    env = dict(PATH=f"{stubs}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="node1", REQUEUED=str(tmp_path / "requeued"))
    sbatch = ["bash", str(tmp_path / "step.sbatch"), *SIZE, f"--data_dir={data}", "--eval_interval=2",
              f"--out_dir={out}", f"--tensorboard_dir={tb}"]

    job, faults = start(sbatch, tmp_path, "job1", [dict(attempt=0, victim=0, signal="SIGKILL", at="step",
                                                        step=3), dict(attempt=1, at="hold", step=6)], env)
    wait_for(faults / "held-1-0", "job 1's second attempt never reached step 6")
    for pid in [job.pid] + [int(open(p).read()) for p in glob.glob(str(faults / "pid-1-*"))] + \
            [int(open(f"/proc/{job.pid}/task/{job.pid}/children").read().split()[0])]:
        os.kill(pid, signal.SIGKILL)   # the node is lost: the script, torchrun and both ranks
    log1, err1 = finish(job, tmp_path, "job1", rc=-9)
    assert gone_lines(err1) == [gone(1, 0, f"{out}/ckpt-00000002.pt")], err1[-3000:]
    assert resumed_from(log1) == [2]

    job, faults = start(sbatch, tmp_path, "job2", [dict(attempt=0, at="hold", step=10)], env)
    wait_for(faults / "held-0-1", "job 2 never reached step 10")
    job.send_signal(signal.SIGUSR1)   # Slurm's warning, 5 minutes before the time limit
    log2, _ = finish(job, tmp_path, "job2")
    assert resumed_from(log2) == [4] and "stopped by SIGTERM after step 10: saved" in log2
    assert (tmp_path / "requeued").read_text() == "4242\n"

    log3, _ = run(sbatch, tmp_path, "job3", env=env)
    assert resumed_from(log3) == [10] and "done: 16 iters" in log3
    same_final_state(out, tmp / "straight")
    each_step_once(out, list(range(0, 17, 2)))
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 17))
    assert [e.step for e in acc.Scalars("val_loss")] == list(range(0, 17, 2))
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == \
        [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in records(out) if "val_loss" in r]


def test_one_run_over_2_and_3_ranks_fsdp_and_ddp_through_every_fault_ends_at_one_process_s_losses(tmp_path):
    """One run (a checkpoint at every step) carried by five torchrun jobs, each the same command but
    for its world size and mode, each continuing from the newest whole checkpoint the last left:
    1. FSDP on 2 ranks, sharded checkpoints, restarted by torchrun after kill -9 of rank 1 once its
       files of a folder are written, of rank 0 after the manifest (before the rename), of rank 1
       just after the rename, of rank 0 while an old folder is being deleted (the growth's step),
       then SIGTERM to rank 1 while it writes its files: the ranks save and stop.
    2. FSDP on 3 ranks from that 2-rank folder; SIGTERM to rank 2 during the rotation.
    3. FSDP on 2 ranks from the 3-rank folder; a full disk on rank 1 mid-write: one line on each rank,
       the folder before it kept.
    4. DDP on 3 ranks from the 2-rank folder (each rank reads it whole), dist_timeout=20: rank 1
       hangs (SIGSTOP); ranks 0 and 2 give up after dist_timeout and name it in one line each; once
       it is killed, torchrun restarts the ranks, which save a .pt file, then rank 0's disk is full:
       its line, and ranks 1 and 2 name it and its line.
    5. DDP on 2 ranks from the 3-rank file, to the end.
    Every eval recorded once, each within 1e-5 (relative) of one process's."""
    data = write_dataset(tmp_path / "data")
    keys = [f"--data_dir={data}", "--eval_interval=1", f"--out_dir={tmp_path / 'out'}"]
    one = [sys.executable, "train.py", "config/step_350m.py", *SIZE, *keys[:-1], f"--out_dir={tmp_path}/one"]
    run(one, tmp_path, "one")
    script, out = wrapper(tmp_path), tmp_path / "out"
    fsdp = ["--fsdp=True", "--fsdp_checkpoint=sharded"]
    kill = dict(signal="SIGKILL")
    log, err = run(torchrun(2, script, *keys, *fsdp, restarts=4), tmp_path, "leg1", [
        dict(attempt=0, victim=1, at="shards", step=2, **kill),
        dict(attempt=1, victim=0, at="manifest", step=3, **kill),
        dict(attempt=2, victim=1, at="rename", step=4, **kill),
        dict(attempt=3, victim=0, at="rotation", step=6, **kill),
        dict(attempt=4, victim=1, signal="SIGTERM", at="shards", step=8)])
    assert resumed_from(log) == [1, 2, 4, 6], log
    removed = re.findall(r"^removed \S+/(\S+): a save that a kill interrupted$", log, re.M)
    assert removed == ["ckpt-00000002.dcp.tmp", "ckpt-00000003.dcp.tmp", "ckpt-00000004.dcp.tmp"], log
    assert "stopped by a signal to another rank after step 9" in log
    assert len(gone_lines(err)) == 4 and "Traceback" not in err, err[-3000:]

    log, _ = run(torchrun(3, script, *keys, *fsdp), tmp_path, "leg2",
                 [dict(victim=2, signal="SIGTERM", at="rotation", step=10)])
    assert "world size : 3" in log and resumed_from(log) == [9]
    assert "stopped by a signal to another rank after step 11" in log

    log, err = run(torchrun(2, script, *keys, *fsdp), tmp_path, "leg3",
                   [dict(victim=1, signal="FSIZE", at="fsize", step=13)], rc=1)
    assert resumed_from(log) == [11]
    lines = [line for line in err.splitlines() if line.startswith("error:")]   # one on each rank
    assert len(lines) == 2 and all(re.fullmatch(
        rf"error: could not write checkpoint {out}/ckpt-00000013.dcp \(File too large\): it needs about "
        rf"[\d.]+ MiB, [\d,.]+ MiB are free there; the previous one, {out}/ckpt-00000012.dcp, is intact "
        rf"\(checksum verified\): free space, then --init_from=resume", line) for line in lines), err[-3000:]

    hangs = torchrun(3, script, *keys, "--dist_timeout=20", restarts=1)
    job, faults = start(hangs, tmp_path, "leg4", [
        dict(victim=1, signal="SIGSTOP", at="step", step=13),
        dict(attempt=1, victim=0, signal="FSIZE", at="fsize", step=14)])
    def gave_up():
        return [line for line in gone_lines((tmp_path / "leg4.err").read_text()) if "is gone" in line]
    wait_for(lambda: len(gave_up()) == 2, "ranks 0 and 2 never gave up")
    os.kill(int(open(faults / "pid-0-1").read()), signal.SIGKILL)   # its node is gone for good
    log, err = finish(job, tmp_path, "leg4", rc=1)
    assert sorted(gave_up()) == [gone(r, 1, f"{out}/ckpt-00000013.pt", timeout=20) for r in (0, 2)], err
    (full,) = [line[7:] for line in err.splitlines() if line.startswith("error: could not write")]
    assert re.fullmatch(rf"could not write checkpoint {out}/ckpt-00000014.pt \(File too large\): .* the "
                        rf"previous one, {out}/ckpt-00000013.pt, is intact \(checksum verified\): .*", full)
    assert sorted(line for line in gone_lines(err) if "is gone" not in line) == [
        f"error: rank {r}: rank 0 stopped: {full}" for r in (1, 2)], err[-3000:]
    assert resumed_from(log) == [12, 13]

    log, _ = run(torchrun(2, "train.py", *keys), tmp_path, "leg5")
    assert resumed_from(log) == [13] and "done: 16 iters" in log
    ours, one = (records(tmp_path / o) for o in ("out", "one"))
    evals = [(r["step"], r["val_loss"]) for r in ours if "val_loss" in r]
    want = [(r["step"], r["val_loss"]) for r in one if "val_loss" in r]
    assert [s for s, _ in evals] == [s for s, _ in want] == list(range(17))
    assert all(abs(a - b) <= 1e-5 * b for (_, a), (_, b) in zip(evals, want)), (evals, want)
