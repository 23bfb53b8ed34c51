"""What users and schedulers do wrong, in-process (the subprocess cases are in test_faults.py): a run
into a folder that holds another run's checkpoints, a resume under another schedule or other data, a
diverging run, unreadable or odd files where ours should be, a torn metrics line, a re-prepare that
fails halfway. Nothing is lost, and every failure is one line that names the problem and the fix."""
import builtins
import errno
import json
import os
import re
import shlex
import signal

import numpy as np
import pytest
import torch

import train
from data import prepare as prep
from stepgpt import monitor
from stepgpt.checkpoint import checkpoint_files, load_checkpoint
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import write_dataset

TINY = ["--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4",
        "--lora_rank=4", "--eval_iters=2", "--log_interval=1", "--sample_tokens=0", "--warmup_iters=2",
        "--stage_warmup_iters=1", "--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4"]


def run(tmp_path, *extra, out="out", data=None):
    data = data or write_dataset(tmp_path / "data")
    train.main(TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / out}", *extra])
    return data


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# -- a run owns its out_dir ------------------------------------------------------------------------

def test_the_same_command_continues_its_run_ends_it_once_and_refuses_another_runs_folder(tmp_path, capsys):
    """The default init_from=auto: the same command starts the run (out_dir holds no checkpoint),
    continues it (the log's first line names the checkpoint) and, run again at its end, says so in
    one line without training. A run of another seed, model, stage plan or data into that folder is
    refused in one line, and so is an explicit init_from=scratch; the folder is left untouched."""
    data = run(tmp_path, "--stop_at=4")
    out = str(tmp_path / "out")
    first = lambda: capsys.readouterr().out.splitlines()[0]   # noqa: E731
    assert first() == f"init_from=auto: out_dir={out!r} holds no checkpoint: starting the run from scratch"
    run(tmp_path, data=data)
    assert first() == (f"init_from=auto: out_dir={out!r} holds this run: resuming from "
                       f"{out}/ckpt-00000004.pt (step 4)")
    before = {p: os.path.getmtime(p) for p in checkpoint_files(out) + [os.path.join(out, "metrics.jsonl")]}
    run(tmp_path, data=data)
    assert capsys.readouterr().out == (f"out_dir={out!r} holds this run, finished: {out}/ckpt-00000012.pt is "
                                       f"at the end of its schedule (step 12); nothing to train\n")
    other = write_dataset(tmp_path / "other", n_train=5000, seed=3)
    for change, says in (("--seed=7", "seed=1337 (config says 7)"),
                         ("--n_embd=48", "n_embd=32 (config says 48)"),
                         ("--stage_layers=[2, 1]", "stage_layers=[1, 1] (config says [2, 1])"),
                         (f"--data_dir={other}", f"data_dir={data!r} (config says {other!r})")):
        with pytest.raises(UserError) as e:
            run(tmp_path, change, data=data)
        assert one_line(e).startswith(f"out_dir={out!r} holds the checkpoints of another run "
                                      f"({out}/ckpt-00000012.pt: {says}"), str(e.value)
        assert "--init_from=resume" in str(e.value) and "another --out_dir" in str(e.value)
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=scratch", data=data)
    assert "holds the checkpoints of an earlier run" in one_line(e) and "init_from=scratch" in str(e.value)
    assert {p: os.path.getmtime(p) for p in before} == before   # untouched


def test_resume_previous_moves_the_newest_aside_so_a_later_resume_does_not_take_it(tmp_path, capsys):
    data = run(tmp_path, "--keep_checkpoints=2")
    out = str(tmp_path / "out")
    newest, previous = checkpoint_files(out)
    run(tmp_path, "--keep_checkpoints=2", "--init_from=resume_previous", "--eval_interval=3", data=data)
    assert f"moved {newest} aside to {newest}.superseded" in capsys.readouterr().out
    assert os.path.isfile(newest + ".superseded")
    # the run from step 8 saved 9 and 12 (eval_interval 3): its own files are the folder's newest
    assert [os.path.basename(p) for p in checkpoint_files(out)] == ["ckpt-00000012.pt", "ckpt-00000009.pt"]


DIVIDES = "each does an equal share of a step's micro-steps"
GATHERS = "each forward gathers every block from all ranks, so all ranks must run as many"


FSDP = "--fsdp=True"


@pytest.mark.parametrize("keys, world, says, fit", [
    (["--gradient_accumulation_steps=4"], 3, f"gradient_accumulation_steps=4 does not divide over 3 ranks "
     f"({DIVIDES}); this run runs on 1, 2 or 4 ranks, and its checkpoints resume on any of them", [1, 2, 4]),
    (["--gradient_accumulation_steps=12", "--eval_iters=4", FSDP], 3, f"fsdp=True: eval_iters=4 makes 4 "
     f"eval batches, not a multiple of the world size 3 ({GATHERS}); this run runs on 2 or 4 ranks, and its "
     f"checkpoints resume on any of them", [2, 4]),
    (["--gradient_accumulation_steps=3", "--eval_iters=2", FSDP], 2, f"gradient_accumulation_steps=3 does "
     f"not divide over 2 ranks ({DIVIDES}); no world size over 1 divides both: change eval_iters or "
     f"gradient_accumulation_steps", []),
])
def test_a_world_size_that_cannot_hold_the_run_names_those_that_can(tmp_path, keys, world, says, fit):
    """At any world size a run trains on the same tokens (its batches are drawn by global index), so
    a checkpoint moves between world sizes (tests/test_elastic.py); one that does not divide the
    micro-steps (or, under FSDP, the eval batches) is refused in one line naming those that do."""
    from stepgpt import runtime
    data = write_dataset(tmp_path / "data")
    cfg, tokens = load_config(TINY + [f"--data_dir={data}", *keys]), train.load_data(data, 16)[0]
    with pytest.raises(UserError) as e:
        runtime.check_world(cfg, world, tokens)
    assert one_line(e) == says
    for m in fit:   # those it names pass
        runtime.check_world(cfg, m, tokens)


# -- resume under another schedule, other data, a stop before it -----------------------------------

def test_a_checkpoint_past_the_new_schedules_end_is_refused_and_one_at_its_end_finishes(tmp_path, capsys):
    tokens = "--stage_tokens=[384, 384]"                 # 6 + 6 steps of 4 x 16 tokens
    data = run(tmp_path, tokens)
    with pytest.raises(UserError) as e:
        run(tmp_path, tokens, "--init_from=resume", "--batch_size=8", data=data)   # 3 + 3 steps
    assert "is at step 12, past the end of this run's schedule (6 steps" in one_line(e)
    capsys.readouterr()
    run(tmp_path, tokens, "--init_from=resume", data=data)
    out = capsys.readouterr().out
    assert out.endswith("at the end of its schedule (step 12); nothing to train\n") and out.count("\n") == 1


def test_stop_at_before_the_checkpoint_is_one_line(tmp_path):
    data = run(tmp_path)
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=resume", "--stop_at=5", data=data)
    assert "stop_at=5 is before checkpoint" in one_line(e) and "step 12" in str(e.value)


def test_data_prepared_again_from_another_text_is_not_resumed(tmp_path):
    data = run(tmp_path, "--stop_at=4")
    write_dataset(data, n_train=5000, seed=3)            # the same folder, prepared again
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=resume", data=data)
    assert "holds other data than checkpoint" in one_line(e)
    assert "train_tokens 4000 then, 5000 now" in str(e.value)


def test_a_trailing_slash_is_the_same_data_dir(tmp_path):
    data = run(tmp_path, "--stop_at=4")
    run(tmp_path, "--init_from=resume", data=data + "/")
    assert load_checkpoint(str(tmp_path / "out"))["iter_num"] == 12


# -- divergence ------------------------------------------------------------------------------------

def test_the_advice_after_a_divergence_recovers_when_followed(tmp_path):
    """A healthy run to step 8, then a learning rate of 1e30: the error names the checkpoints and their
    val losses and gives a command; following it (the flags it names) trains to the end."""
    data = run(tmp_path, "--stop_at=8", "--eval_interval=2")
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=resume", "--eval_interval=2", "--learning_rate=1e30", data=data)
    message = one_line(e)
    assert message.startswith("non-finite loss or gradient at step") and "ckpt-00000008.pt (step 8" in message
    flags = shlex.split(message.split("learning rate: ")[1])
    assert flags[0] in ("--init_from=resume", "--init_from=resume_previous")
    assert flags[1].startswith("--learning_rate=")
    run(tmp_path, "--eval_interval=2", "--learning_rate=1e30", *flags, data=data)
    final = load_checkpoint(str(tmp_path / "out"))
    assert final["iter_num"] == 12 and np.isfinite(final["best_val_loss"])


def test_a_divergence_with_no_checkpoint_says_to_start_again(tmp_path):
    with pytest.raises(UserError) as e:
        run(tmp_path, "--learning_rate=1e30", "--eval_interval=100")
    assert "No checkpoint was written before it: start again with a lower learning rate, e.g. " \
           "--learning_rate=0.001" in one_line(e)


def test_following_the_divergence_advice_never_loops(tmp_path):
    """A learning rate of 1e30 from the start (a typo for 1e-3), a checkpoint at every step: the
    checkpoint written after the first step already holds weights of ~1e29 (its loss can look sane).
    Each advice is followed as given, continuing (--init_from=...) or starting again in another
    out_dir; it must not name a checkpoint that diverges again, so the second attempt trains to the end."""
    data, out, extra, advice = write_dataset(tmp_path / "data"), "out", ["--learning_rate=1e30"], []
    for attempt in range(3):
        try:
            run(tmp_path, "--eval_interval=1", "--seed=1", *extra, out=out, data=data)
            break
        except UserError as e:
            message = str(e)
        assert message.startswith("non-finite loss or gradient at step") and "\n" not in message
        assert message not in advice, advice
        advice.append(message)
        if "Continue from" in message:   # the flags after "learning rate: " continue the run
            extra = shlex.split(message.split("learning rate: ")[1])
        else:                              # "start again in another --out_dir ..., e.g. FLAGS"
            extra, out = shlex.split(message.split("e.g. ")[1]), f"out{attempt + 1}"
    assert len(advice) == 1, advice
    final = load_checkpoint(str(tmp_path / out))
    assert final["iter_num"] == 12 and np.isfinite(final["best_val_loss"])


def test_a_diverged_checkpoint_whose_val_loss_looks_sane_is_not_named(tmp_path, monkeypatch):
    """The issue's case, made certain: the checkpoint after a 1e30 step scores below the untrained
    model (its step-0 val loss set higher here), yet holds weights of ~1e29 and gives a NaN gradient.
    The advice checks it before naming it, and says to start again; each check alone rejects it."""
    data = write_dataset(tmp_path / "data")
    with pytest.raises(UserError):
        run(tmp_path, "--eval_interval=1", "--learning_rate=1e30", data=data)
    out = str(tmp_path / "out")
    lines = [{**r, "val_loss": 99.0} if r.get("step") == 0 and "val_loss" in r else r for r in records(out)]
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    with pytest.raises(UserError) as e:   # the advice of the main line: continue from it
        run(tmp_path, "--eval_interval=1", "--init_from=resume", "--learning_rate=0.001", data=data)
    message = one_line(e)
    ckpt = os.path.join(out, "ckpt-00000001.pt")
    assert f"training cannot go on from {ckpt} (weights up to " in message and "Continue from" not in message
    assert message.endswith("start again in another --out_dir with a lower learning rate, e.g. "
                            "--learning_rate=0.0001")
    monkeypatch.setattr(monitor, "SANE_WEIGHT", float("inf"))   # the gradient check alone
    train_data = np.memmap(os.path.join(data, "train.bin"), dtype=np.uint16, mode="r")
    assert monitor.why_not_resumable(ckpt, train_data).startswith(
        "a non-finite gradient on the data: loss ")


def test_the_advised_learning_rate_keeps_min_lr_below_it(tmp_path):
    """A tenth of learning_rate=min_lr=1e-4 is under min_lr, which the config refuses: the advice lowers
    min_lr with it, so that following it does not end in a config error."""
    from types import SimpleNamespace
    cfg = load_config(TINY + [f"--out_dir={tmp_path}", "--learning_rate=1e-4", "--min_lr=1e-4"])
    advice = monitor.divergence_advice(SimpleNamespace(cfg=cfg, master=True, data={}))
    flags = advice.split("e.g. ")[1]
    assert flags == "--learning_rate=1e-05 --min_lr=1e-06"
    load_config(TINY + shlex.split(flags))


# -- out of memory -----------------------------------------------------------------------------------

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
            "which 1.06 GiB is free. Of the allocated memory 76.10 GiB is allocated by PyTorch")


@pytest.mark.parametrize("wrapped", [False, True])
def test_out_of_memory_at_a_stage_change_is_one_line_naming_the_step_and_the_checkpoint(tmp_path, monkeypatch,
                                                                                        wrapped):
    """torch.OutOfMemoryError in the growth at step 4 (raised as such, or wrapped as torch.compile wraps
    what it runs): one line with the step and stage, what was asked for, the stage's planned peak, the
    keys that lower it and the checkpoint to continue from. Any other error is left as it is."""
    def grows_out_of_memory(run, raw, opt, stage, it):
        if not wrapped:
            raise torch.OutOfMemoryError(CUDA_OOM)
        try:
            raise torch.OutOfMemoryError(CUDA_OOM)
        except torch.OutOfMemoryError as e:
            raise RuntimeError("backend compiler failed") from e

    def a_bug(*args):
        raise RuntimeError("a bug")

    data = write_dataset(tmp_path / "data")
    monkeypatch.setattr(train, "enter_stage", grows_out_of_memory)
    with pytest.raises(UserError) as e:
        run(tmp_path, "--max_iters=8", "--eval_interval=2", data=data)
    message = one_line(e)
    ckpt = os.path.join(tmp_path, "out", "ckpt-00000002.pt")
    assert message.startswith("out of memory at step 4 (stage 2/2) on cpu: it tried to allocate 2.00 GiB; "
                              "the planned step peak of stage 2 is "), message
    assert "of RAM available" in message
    assert message.endswith(f"{monitor.LOWER_PEAK}; then continue from {ckpt} with --init_from=resume")
    monkeypatch.setattr(train, "enter_stage", a_bug)
    with pytest.raises(RuntimeError, match="^a bug$"):
        run(tmp_path, "--max_iters=8", "--eval_interval=2", "--init_from=resume", data=data)


def test_the_out_of_memory_line_on_a_gpu_names_its_total_and_free_memory(tmp_path, monkeypatch):
    """The CUDA branch, with a stubbed torch.OutOfMemoryError and device: the planned peak is the one
    train.py prints for the stage (bf16 activations), against the GPU's total and free memory."""
    from stepgpt import memory
    import grow
    data = write_dataset(tmp_path / "data")
    cfg = load_config(TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**20, 80 * 2**30))
    with train.setup(cfg) as r:
        r.device, r.dtype = torch.device("cuda:0"), "bfloat16"
        final = grow.model_config(cfg, 2, r.vocab_size)
        planned = monitor.fmt_bytes(memory.configured_peaks(cfg, final, [1, 1], "bfloat16")[1])
        line = monitor.out_of_memory_line(r, 7, torch.OutOfMemoryError(CUDA_OOM))
        cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 409600000 bytes. Error code 12")
        assert "it tried to allocate 390.6MiB;" in monitor.out_of_memory_line(r, 7, cpu)
    assert line == (f"out of memory at step 7 (stage 2/2) on cuda:0: it tried to allocate 2.00 GiB; the "
                    f"planned step peak of stage 2 is {planned}, against the 80.00GiB of cuda:0 (3.0MiB free "
                    f"now): {monitor.LOWER_PEAK}; then start again (no checkpoint was written yet)")
    assert monitor.is_out_of_memory(cpu) and not monitor.is_out_of_memory(RuntimeError("shape mismatch"))


# -- odd or unreadable files where ours should be --------------------------------------------------

def test_a_directory_named_like_the_newest_checkpoint(tmp_path):
    data = run(tmp_path, "--stop_at=8")
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "ckpt-00000010.pt"))
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=resume", data=data)
    assert "ckpt-00000010.pt is unusable (not a file)" in one_line(e) and "resume_previous" in str(e.value)
    with pytest.raises(UserError) as e:                 # sample.py and grow.py read a folder's newest
        load_checkpoint(out)
    assert "ckpt-00000008.pt: pass that file" in one_line(e)


def test_rotation_leaves_a_directory_alone(tmp_path):
    os.makedirs(tmp_path / "out" / "ckpt-00000001.pt")
    with pytest.raises(UserError):                      # a folder with something named like a checkpoint
        run(tmp_path)
    os.rmdir(tmp_path / "out" / "ckpt-00000001.pt")
    os.makedirs(tmp_path / "out" / "ckpt-00000099.pt.tmp")
    run(tmp_path, "--keep_checkpoints=1")               # a directory among the temp names: not ours to remove
    assert [os.path.basename(p) for p in checkpoint_files(str(tmp_path / "out"))] == ["ckpt-00000012.pt"]


@pytest.mark.parametrize("name", ["meta.json", "train.bin", "val.bin"])
def test_unreadable_data_files_are_one_line(tmp_path, monkeypatch, name):
    data = write_dataset(tmp_path / "data")
    real_open = builtins.open

    def denied(path, *a, **k):
        if os.fspath(path) == os.path.join(data, name):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(UserError) as e:
        run(tmp_path, data=data)
    assert f"cannot read {os.path.join(data, name)} (Permission denied)" in one_line(e)


def test_an_unreadable_checkpoint_is_one_line(tmp_path, monkeypatch):
    data = run(tmp_path, "--stop_at=8")
    newest = checkpoint_files(str(tmp_path / "out"))[0]
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, "Permission denied", path)) if os.fspath(path) == newest
        else real_open(path, *a, **k))
    with pytest.raises(UserError) as e:
        run(tmp_path, "--init_from=resume", data=data)
    assert "is unusable (unreadable (Permission denied))" in one_line(e)


@pytest.mark.parametrize("tail", ['{"step": 9, "loss": 3.', "\n"])
def test_a_torn_or_blank_last_metrics_line_is_dropped_on_resume(tmp_path, capsys, tail):
    data = run(tmp_path, "--stop_at=8")
    with open(tmp_path / "out" / "metrics.jsonl", "a") as f:
        f.write(tail)                                    # a kill in the middle of a write
    run(tmp_path, "--init_from=resume", data=data)
    assert "1 torn or blank line(s) dropped" in capsys.readouterr().out
    steps = [r["step"] for r in records(tmp_path / "out") if "val_loss" in r]
    assert steps == [0, 4, 8, 12]


# -- the eval a signal-saved checkpoint lacks ------------------------------------------------------

def test_a_checkpoint_saved_on_a_signal_before_an_eval_step_gets_that_eval_on_resume(tmp_path, monkeypatch,
                                                                                     capsys):
    """SIGTERM during step 7: the run saves after it, at step 8, before step 8's eval; the resumed
    run evaluates step 8 first, so its metrics equal a straight run's (it once skipped that eval)."""
    data = run(tmp_path, out="straight")
    real_step = train.train_step

    def signalled(run_, model, raw, opt, it):
        out = real_step(run_, model, raw, opt, it)
        if it == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    with monkeypatch.context() as m:
        m.setattr(train, "train_step", signalled)
        run(tmp_path, data=data)
    assert "stopped by SIGTERM after step 8" in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "out"))["evaluated"] is False
    run(tmp_path, "--init_from=resume", data=data)
    evals = lambda out: [(r["step"], r["val_loss"]) for r in records(out) if "val_loss" in r]   # noqa: E731
    assert evals(tmp_path / "out") == evals(tmp_path / "straight")


# -- prepare ---------------------------------------------------------------------------------------

def test_a_reprepare_that_fails_halfway_leaves_the_earlier_folder_usable(tmp_path, monkeypatch):
    texts = tmp_path / "texts"
    os.makedirs(texts)
    (texts / "a.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    out = str(tmp_path / "data")
    meta = prep.prepare(str(texts), out, vocab_ranks=512, workers=1)
    before = {n: open(os.path.join(out, n), "rb").read() for n in ("meta.json", "train.bin", "val.bin")}

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep, "write_tokens", disk_full)
    with pytest.raises(OSError, match=re.escape(f"could not write {out}/tokens.tmp (No space left on")):
        prep.prepare(str(texts), out, vocab_ranks=256, workers=1)
    assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before
    assert train.load_data(out, 16)[1] == meta
