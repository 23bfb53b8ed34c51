"""Faults a long run survives: SIGTERM/SIGINT (pre-emption), SIGKILL at any moment (also while a
checkpoint is being written), a full disk at save time. Every resumed run must end bit for bit where
a run that was never interrupted ends (CPU)."""
import errno
import os
import re
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from stepgpt import checkpoint, monitor
import train
from stepgpt.checkpoint import checkpoint_files, load_checkpoint
from stepgpt.errors import UserError
from tests.helpers import HANG, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--device=cpu",
       "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4", "--lora_rank=4",
       "--eval_iters=2", "--log_interval=1", "--sample_tokens=0", "--warmup_iters=3",
       "--stage_warmup_iters=2", "--stage_layers=[1, 1]", "--max_iters=40", "--eval_interval=6",
       "--relora_every=7", "--keep_checkpoints=2"]
# train.py with a pause at a chosen point, so that the test's signal or kill lands there however
# busy the machine is. PAUSE_STEP=k: after the log line of step k, until a SIGTERM or SIGINT (which
# the run then handles) or a SIGKILL. PAUSE_SAVE=n: inside the process's first checkpoint write,
# after n bytes of it, until killed. It creates PAUSE_MARK when it pauses.
PAUSE = (
    "import os, sys, time\n"
    f"sys.path.insert(0, {ROOT!r})\n"
    "import train\nfrom stepgpt import checkpoint, errors, monitor, runtime\n"
    "step, save = int(os.environ.get('PAUSE_STEP', -1)), int(os.environ.get('PAUSE_SAVE', -1))\n"
    "signalled, written = [], []\n"
    "def pause():\n"
    "    open(os.environ['PAUSE_MARK'], 'w').close()\n"
    "    while not signalled:\n"
    "        time.sleep(0.01)\n"
    "handle = runtime.StopRequest.handle\n"
    "def handled(self, *a):\n"
    "    handle(self, *a)\n"
    "    signalled.append(1)\n"
    "log = monitor.Logger.print\n"
    "def logged(self, *a, **k):\n"
    "    log(self, *a, **k)\n"
    "    if str(a[0]).startswith(f'step {step:>6}/'):\n"
    "        pause()\n"
    "write = checkpoint._HashingWriter.write\n"
    "def slow(self, b):\n"
    "    n = write(self, b)\n"
    "    written.append(len(b))\n"
    "    if 0 <= save < sum(written):\n"
    "        self.f.flush()\n"
    "        pause()\n"
    "    return n\n"
    "runtime.StopRequest.handle, monitor.Logger.print = handled, logged\n"
    "checkpoint._HashingWriter.write = slow\n"
    "errors.run_cli(train.main)\n")


def same_final_state(a, b):
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert ca["iter_num"] == cb["iter_num"] == 40
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    data = write_dataset(tmp / "data")
    train.main(RUN + [f"--data_dir={data}", f"--out_dir={tmp / 'straight'}"])
    return tmp, data


def start(out, data, script, env=None, extra=()):
    """The same command every time: the default init_from=auto continues the run out holds."""
    return subprocess.Popen([sys.executable, script, *RUN, *extra, f"--data_dir={data}", f"--out_dir={out}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def paused(out, data, tmp_path, extra=(), **at):
    """train.py (the same command: it continues the run if out holds one), started with PAUSE at `at`
    (PAUSE_STEP=k or PAUSE_SAVE=n); -> the process once it has paused there, or has ended."""
    mark = tmp_path / "paused"
    if mark.exists():
        mark.unlink()
    (tmp_path / "pause.py").write_text(PAUSE)
    env = {**os.environ, "PAUSE_MARK": str(mark), **{f"PAUSE_{k.upper()}": str(v) for k, v in at.items()}}
    proc = start(out, data, str(tmp_path / "pause.py"), env, extra)
    while not mark.exists() and proc.poll() is None:
        time.sleep(0.01)
    return proc


def test_sigterm_and_sigint_save_and_exit_cleanly(straight, tmp_path):
    """SIGTERM at step 9, then SIGINT at step 20 of the resumed run: each time the step finishes, a
    checkpoint is saved, one line says how to continue, exit status 0; the run resumed to its end
    is the straight one."""
    _, data = straight
    out = tmp_path / "out"
    for sig, step in ((signal.SIGTERM, 9), (signal.SIGINT, 20)):
        proc = paused(out, data, tmp_path, step=step)
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=HANG)
        assert proc.returncode == 0, err
        line = [ln for ln in rest.splitlines() if ln.startswith("stopped by")][0]
        assert f"stopped by {sig.name} after step {step}:" in line and "the same command continues it" in line
        assert load_checkpoint(str(out))["iter_num"] == step
    proc = start(out, data, "train.py")
    proc.communicate(timeout=HANG)
    assert proc.returncode == 0
    same_final_state(straight[0] / "straight", out)


def test_sigkill_anywhere_then_the_same_command_is_bit_exact(straight, tmp_path):
    """Killed at random steps and twice while a checkpoint is half written; each time the same
    command again (as a requeue runs it), which continues the run; its end is the straight one's."""
    _, data = straight
    out = tmp_path / "out"
    size = os.path.getsize(checkpoint_files(str(straight[0] / "straight"))[0])
    rng = random.Random(0)
    torn = 0
    for kind in ["step", "save", "step", "save"]:
        done = load_checkpoint(str(out))["iter_num"] if checkpoint_files(str(out)) else 0
        at = dict(save=rng.randint(1, size // 2)) if kind == "save" else dict(step=rng.randint(done + 1, 39))
        proc = paused(out, data, tmp_path, **at)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.kill()
        proc.communicate()
        if kind == "save":   # the kill landed inside the write
            torn += any(n.endswith(".pt.tmp") for n in os.listdir(out))
    assert torn == 2
    proc = start(out, data, "train.py")
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 0, err
    same_final_state(straight[0] / "straight", out)


def test_sigterm_and_sigkill_of_a_muon_run_then_resume_is_bit_exact(straight, tmp_path):
    """optimizer=muon (its momentum buffers in the checkpoint): SIGTERM at step 9 (saved, exit 0), then
    killed at a step after the growth and inside a checkpoint's write, resumed each time; it ends
    where the straight run ends, every tensor and the optimizer state bit for bit."""
    _, data = straight
    muon = ["--optimizer=muon"]
    train.main(RUN + muon + [f"--data_dir={data}", f"--out_dir={tmp_path / 'straight'}"])
    out = tmp_path / "out"
    size = os.path.getsize(checkpoint_files(str(tmp_path / "straight"))[0])
    for sig, at in ((signal.SIGTERM, dict(step=9)), (signal.SIGKILL, dict(step=23)),
                    (signal.SIGKILL, dict(save=size // 3))):
        proc = paused(out, data, tmp_path, muon, **at)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG)
        assert proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL), err[-3000:]
    assert any(n.endswith(".pt.tmp") for n in os.listdir(out))   # the last kill landed inside a write
    proc = start(out, data, "train.py", extra=muon)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 0, err
    same_final_state(tmp_path / "straight", out)
    assert any("momentum_buffer" in s for s in load_checkpoint(str(out))["optimizer"]["state"].values())


def test_full_disk_keeps_the_previous_checkpoint_and_stops_with_one_line(straight, tmp_path, monkeypatch):
    _, data = straight
    out = tmp_path / "out"
    write, saves = checkpoint._HashingWriter.write, []

    def disk_fills_up(self, b):
        if len(saves) >= 2:                                 # the third save runs out of space half way
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, b)

    real_save = checkpoint.save_checkpoint

    def counting_save(path, state, keep=0):
        try:
            return real_save(path, state, keep)
        finally:
            saves.append(path)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", disk_fills_up)
    monkeypatch.setattr(checkpoint, "save_checkpoint", counting_save)
    with pytest.raises(UserError, match=r"could not write checkpoint .*ckpt-00000018.pt "
                                        r"\(No space left on device\): it needs about [\d.]+ MiB, "
                                        r"[\d,.]+ MiB are free there; the previous one, "
                                        r".*ckpt-00000012.pt, is intact \(checksum verified\): free space, "
                                        r"then --init_from=resume"):
        train.main(RUN + [f"--data_dir={data}", f"--out_dir={out}"])
    # no temp file
    assert sorted(os.listdir(out)) == ["ckpt-00000006.pt", "ckpt-00000012.pt", "metrics.jsonl", "run.lock"]
    assert load_checkpoint(str(out))["iter_num"] == 12


def test_unwritable_out_dir_is_one_line_before_any_work(straight, tmp_path):
    _, data = straight
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    proc = subprocess.run([sys.executable, "train.py", *RUN, f"--data_dir={data}",
                           f"--out_dir={blocker / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "is not writable" in proc.stderr and "choose another --out_dir" in proc.stderr


def limited(max_bytes):
    """preexec_fn: the child may write files of at most max_bytes (`ulimit -f`); Python ignores
    SIGXFSZ, so a write past it fails with EFBIG, as a full disk fails with ENOSPC."""
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


def test_a_file_size_limit_at_save_time_is_one_line_and_keeps_the_previous_checkpoint(straight, tmp_path):
    """A real failed write (ulimit -f, below the checkpoint's size) in a real run: one line naming the
    bytes needed, no temp file left, the previous checkpoint intact and verified."""
    _, data = straight
    out = tmp_path / "out"
    train.main(RUN + [f"--data_dir={data}", f"--out_dir={out}", "--stop_at=6"])
    size = os.path.getsize(checkpoint_files(str(out))[0])
    proc = subprocess.run([sys.executable, "train.py", *RUN, f"--data_dir={data}", f"--out_dir={out}",
                           "--init_from=resume"], cwd=ROOT, capture_output=True, text=True, timeout=HANG,
                          preexec_fn=limited(size // 2))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert re.search(r"could not write checkpoint .*ckpt-00000012.pt \(File too large\): it needs about "
                     r"[\d.]+ MiB, .* the previous one, .*ckpt-00000006.pt, is intact \(checksum verified\)",
                     proc.stderr), proc.stderr
    assert sorted(os.listdir(out)) == ["ckpt-00000006.pt", "metrics.jsonl", "run.lock"]


# train.py under an address-space limit (`ulimit -v`) of 1 GiB above what its imports mapped: set after
# them, so that the margin does not depend on how much a torch build maps at import
UNDER_1GIB = (
    "import os, resource, sys\n"
    f"sys.path.insert(0, {ROOT!r})\n"
    "import train\nfrom stepgpt import errors\n"
    "size = next(int(line.split()[1]) * 1024 for line in open('/proc/self/status')\n"
    "            if line.startswith('VmSize'))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
    "sys.argv[0] = 'train.py'\n"
    "errors.run_cli(train.main)\n")


def test_out_of_memory_in_a_training_step_is_one_line(straight, tmp_path):
    """A batch that cannot fit (200,000 sequences: a planned peak of GiBs) in a real run on the CPU under
    an address-space limit: the allocator's RuntimeError in the first resumed step ends the run in one
    line, no traceback, naming the step and stage, what it tried to allocate, the planned peak against
    the RAM and the limit, the keys that lower it and the checkpoint to continue from."""
    _, data = straight
    out = tmp_path / "out"
    train.main(RUN + [f"--data_dir={data}", f"--out_dir={out}", "--stop_at=6"])
    proc = subprocess.run([sys.executable, "-c", UNDER_1GIB, *RUN, f"--data_dir={data}", f"--out_dir={out}",
                           "--init_from=resume", "--batch_size=200000"], cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    ckpt = os.path.join(out, "ckpt-00000006.pt")
    fix = f"{monitor.LOWER_PEAK}; then continue from {ckpt} with --init_from=resume\n"
    assert re.fullmatch(r"error: out of memory at step 6 \(stage 1/2\) on cpu: it tried to allocate "
                        r"[\d.]+[MG]iB; the planned step peak of stage 1 is [\d.]+GiB, against the "
                        r"[\d.]+[MG]iB of RAM available and the address-space limit of [\d.]+GiB "
                        r"\(ulimit -v\): " + re.escape(fix), proc.stderr), proc.stderr
    for key in ("batch_size", "gradient_accumulation_steps", "activation_checkpointing", "loss_chunk"):
        assert key in proc.stderr


def test_a_prepare_that_hits_a_file_size_limit_leaves_the_earlier_folder_usable(tmp_path):
    texts = tmp_path / "texts"
    os.makedirs(texts)
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"Part {i}: to be, or not to be, that is the question.\n" * 400)
    out = tmp_path / "data"
    cmd = [sys.executable, "data/prepare.py", f"--source={texts}", f"--out={out}", "--vocab_ranks=512",
           "--workers=1"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=HANG)
    before = {n: (out / n).read_bytes() for n in ("meta.json", "train.bin", "val.bin")}
    proc = subprocess.run(cmd[:-2] + ["--vocab_ranks=300", "--workers=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG, preexec_fn=limited(2000))
    last = proc.stderr.strip().splitlines()[-1]   # after tqdm's progress bar
    assert proc.returncode != 0 and last.startswith("error: could not write") and "tokens.tmp" in last, \
        proc.stderr[-2000:]
    assert {n: (out / n).read_bytes() for n in before} == before


def test_a_second_prepare_into_a_folder_being_prepared_stops_or_waits(tmp_path):
    """While one process prepares a folder (here: the test holds its prepare.lock), data/prepare.py
    into it stops at once in one line, before it writes anything; train.py's first use of the
    default data (prepare(if_missing=True)) waits, then takes what the first process wrote."""
    from stepgpt.lock import FolderLock
    texts = tmp_path / "texts"
    os.makedirs(texts)
    (texts / "a.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    out = tmp_path / "data"
    with FolderLock(str(out), "prepare.lock", "the data folder", "another --out"):
        proc = subprocess.run([sys.executable, "data/prepare.py", f"--source={texts}", f"--out={out}",
                               "--vocab_ranks=512", "--workers=1"], cwd=ROOT, capture_output=True, text=True,
                              timeout=HANG)
        assert sorted(os.listdir(out)) == ["prepare.lock"]
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is in use by another process (pid" in proc.stderr and "prepare into another --out" in proc.stderr
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from data.prepare import prepare; "
            f"print(prepare({str(texts)!r}, {str(out)!r}, vocab_ranks=512, workers=1, if_missing=True)"
            f"['source'])")
    with FolderLock(str(out), "prepare.lock", "the data folder", "another --out"):
        user = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert user.stdout.readline().startswith("waiting for the process that holds the data folder")
        write_dataset(str(out))                          # what the first process prepares
    rest, _ = user.communicate(timeout=HANG)
    assert user.returncode == 0 and rest.strip() == "synthetic test data"   # taken, not prepared again
