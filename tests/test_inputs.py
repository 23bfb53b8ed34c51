"""Bad input to every script ends in one line naming the problem and the fix, before any work: damaged
prepared data, bad sampling arguments, an unknown device, and a second run into a live run's out_dir."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

import train
from stepgpt.errors import UserError
from tests.helpers import HANG, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--device=cpu",
       "--n_layer=1", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2",
       "--eval_iters=1", "--sample_tokens=0", "--log_interval=1", "--warmup_iters=1"]


def one_line_error(argv, timeout=HANG):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, \
        (proc.returncode, proc.stderr[-2000:])
    return proc.stderr


@pytest.mark.parametrize("damage, message", [
    (lambda d: open(os.path.join(d, "meta.json"), "w").write("{not json"), "is not valid JSON"),
    (lambda d: open(os.path.join(d, "meta.json"), "w").write(json.dumps({"vocab_size": 100})),
     "lacks tokenizer, eot_token, dtype"),
    (lambda d: open(os.path.join(d, "train.bin"), "ab").write(b"\0"),
     "holds 8001 bytes, not a whole number of uint16 tokens"),
])
def test_damaged_prepared_data_is_one_line(tmp_path, damage, message):
    data = write_dataset(tmp_path / "data")
    damage(data)
    with pytest.raises(UserError, match=message) as e:
        train.main(RUN + [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert "python data/prepare.py" in str(e.value)


def test_bad_sampling_arguments_are_one_line_before_loading_anything():
    """sample.py's arguments are checked before the checkpoint is read (it does not exist either):
    the first case as a user runs the script, the rest in-process through the same check."""
    import sample
    assert "--max_new_tokens -1 must be >= 1" in one_line_error(["sample.py", "--ckpt=no-such-run",
                                                                  "--max_new_tokens=-1"])
    for arg, message in (("--temperature=-1", "--temperature -1.0 must be >= 0"),
                         ("--top_k=-5", "--top_k -5 >= 0"),
                         ("--prompt=FILE:no/such/prompt.txt", "cannot read no/such/prompt.txt")):
        with pytest.raises(UserError, match=re.escape(message)):
            sample.main(["--ckpt=no-such-run", arg])


def test_an_unknown_device_is_one_line():
    assert "device='tpu': use auto, cpu, cuda, cuda:N or mps" in one_line_error(["train.py", "--device=tpu"])


def test_a_second_run_into_a_live_out_dir_stops_at_once_and_a_killed_run_leaves_no_lock(tmp_path):
    data = write_dataset(tmp_path / "data")
    out = tmp_path / "out"
    args = ["train.py", *RUN, f"--data_dir={data}", f"--out_dir={out}"]
    first = subprocess.Popen([sys.executable, *args, "--max_iters=100000", "--eval_interval=100000"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while "step      1/" not in first.stdout.readline():   # training: it holds the lock
            assert first.poll() is None, "the first run ended early"
        error = one_line_error(args + ["--max_iters=2"])
        assert f"is in use by another process (pid {first.pid} on " in error
        assert "choose another --out_dir" in error
        assert first.poll() is None   # it stopped at once: it did not wait for the first run to end
    finally:
        first.send_signal(signal.SIGKILL)   # the lock goes with the process, however it dies
        first.wait()
    proc = subprocess.run([sys.executable, *args, "--max_iters=2", "--eval_interval=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0 and "done: 2 iters" in proc.stdout, proc.stderr[-2000:]
