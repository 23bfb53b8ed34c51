"""Experiment tracking, offline: TensorBoard's event files (read back with TensorBoard's own reader)
and a W&B run in offline mode (its transaction log read back with W&B's own record schema) hold what
metrics.jsonl holds; a run that dies and resumes adds no step twice to either; a missing package is
one line; a W&B without an API key or without a server runs offline, says so, and trains."""
import glob
import json
import socket
import struct
import sys

import numpy as np
import pytest

import train
from stepgpt import monitor
from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import UserError
from tests.helpers import write_dataset
from tests.test_train import args, metrics

# a growth at step 6, a ReLoRA restart at 10, checkpoints at 4 and 8
COMMON = ["--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4", "--log_interval=1",
          "--relora_every=4", "--keep_checkpoints=5"]
TIMED = {"ms_per_step", "tokens_per_s"}   # wall-clock values: a replayed step has other ones


def died_and_resumed(tmp_path, monkeypatch, *extra):
    """A run that dies in step 10 (records up to step 10 written, newest checkpoint at 8), then
    resumed to the end."""
    data = write_dataset(tmp_path / "data")
    real = train.train_step

    def dies_at_10(run, model, raw, opt, it):
        if it == 10:
            raise KeyboardInterrupt   # no checkpoint, as if the process were killed
        return real(run, model, raw, opt, it)

    monkeypatch.setattr(train, "train_step", dies_at_10)
    with pytest.raises(KeyboardInterrupt):
        train.main(args(tmp_path, *COMMON, *extra, data=data))
    assert max(m["step"] for m in metrics(tmp_path)) == 10
    monkeypatch.setattr(train, "train_step", real)
    train.main(args(tmp_path, *COMMON, *extra, "--init_from=resume", data=data))


def expected_scalars(tmp_path):
    """{name: {step: value}} as the trackers get metrics.jsonl: one value per name and step, the
    first (at a stage boundary the training record's stage comes before the merge's and the eval's)."""
    out = {}
    for m in metrics(tmp_path):
        for k, v in m.items():
            if k != "step" and v is not None:
                out.setdefault(k, {}).setdefault(m["step"], v)
    return out


def test_tensorboard_holds_the_metrics_and_a_resume_adds_no_step_twice(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="pip install tensorboard==2.21.0 (requirements-test.txt)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = tmp_path / "tb"
    died_and_resumed(tmp_path, monkeypatch, f"--tensorboard_dir={tb}")
    assert len(glob.glob(str(tb / "events.out.tfevents.*"))) == 2          # one file per attempt
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    want = expected_scalars(tmp_path)
    assert set(acc.Tags()["scalars"]) == set(want) >= {"loss", "lr", "grad_norm", "tokens_per_s", "stage",
                                                       "val_loss", "train_loss", "merge_kept", "plan_bytes"}
    for name, values in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == sorted(values), name                 # each step once, in order
        assert [v for _, v in got] == [float(np.float32(values[s])) for s in sorted(values)], name
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 13))
    assert [e.step for e in acc.Scalars("stage") if e.value == 2] == list(range(7, 13))
    marks = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")}
    assert sorted(marks) == [6, 10] and marks[6].startswith("== stage 2/2") and "ReLoRA" in marks[10]
    config = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("config/text_summary")]
    assert [e.step for e in acc.Tensors("config/text_summary")] == [0, 9]   # the first step of each attempt
    assert all("| learning_rate | 0.001 |" in c for c in config) and "| init_from | resume |" in config[1]


# -- W&B ------------------------------------------------------------------------------------------

@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B with every file under tmp_path, no credentials and no network; its session (which reads
    the environment once) torn down before and after."""
    wandb = pytest.importorskip("wandb", reason="pip install wandb==0.31.0 (requirements-test.txt)")
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY",
                "WANDB_DIR"):   # unset: runs go to out_dir/wandb
        monkeypatch.delenv(key, raising=False)
    for key, sub in (("WANDB_CONFIG_DIR", "wandb-config"),
                     ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    wandb.teardown()
    yield wandb
    wandb.teardown()


def wandb_records(run_folder):
    """The records of an offline run's transaction log (run-<id>.wandb): W&B's header, then LevelDB's
    log format (32 KiB blocks of chunks with a 7-byte header), each record a protobuf of W&B's schema."""
    from wandb.proto import wandb_internal_pb2
    (path,) = glob.glob(f"{run_folder}/run-*.wandb")
    data, pos, chunk, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                       # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):                  # FULL, or LAST of a record cut over blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_run(run_folder):
    """The run record of an offline run (its id, name, project), the first its log holds."""
    return next(r.run for r in wandb_records(run_folder) if r.WhichOneof("record_type") == "run")


def wandb_history(run_folder):
    """[{name: value, '_step': step}] of an offline run, without W&B's own _timestamp/_runtime."""
    rows = []
    for r in wandb_records(run_folder):
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in row.items() if k in ("_step",) or not k.startswith("_")})
    return rows


@pytest.mark.slow   # wandb.init starts W&B's service process (wandb-core)
def test_wandb_offline_run_holds_the_metrics_and_a_resume_adds_no_step_twice(tmp_path, monkeypatch,
                                                                            wandb_env, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    died_and_resumed(tmp_path, monkeypatch, "--wandb_log=True", "--wandb_run_name=tiny")
    out = capsys.readouterr().out
    assert out.count("wandb: offline (WANDB_MODE=offline)") == 2
    wandb_env.teardown()   # W&B's service writes the transaction log on after run.finish(); this ends it
    # the attempts in the order of their steps, the run id from their own records: W&B names a folder
    # offline-run-<second>-<id>, and -<id>-1 when the resumed attempt starts in the first's second
    folders = sorted(glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*")),
                     key=lambda f: wandb_history(f)[0]["_step"])
    assert len(folders) == 2 and len({wandb_run(f).run_id for f in folders}) == 1   # one run id
    run_id = wandb_run(folders[0]).run_id
    assert load_checkpoint(str(tmp_path / "out"))["wandb_id"] == run_id
    first, second = (wandb_history(f) for f in folders)
    # W&B keeps what it was sent: the resumed attempt sends only the steps after 10, the last one
    # the attempt that died sent, although it replays 9 and 10
    assert [r["_step"] for r in first] == list(range(11)) and [r["_step"] for r in second] == [11, 12]
    want = expected_scalars(tmp_path)
    got = {}
    for row in first + second:
        for k, v in row.items():
            if k != "_step":
                got.setdefault(k, {})[row["_step"]] = v
    assert set(got) == set(want)
    for name in set(want) - TIMED:
        assert got[name] == want[name], name       # bit for bit on CPU, the replayed 9 and 10 too
    for name in TIMED:
        assert sorted(got[name]) == sorted(want[name]) and got[name][12] == want[name][12]
    resumed = wandb_run(folders[1])
    assert resumed.run_id == run_id and resumed.display_name == "tiny" and resumed.project == "step-gpt"
    config = {}
    for r in wandb_records(folders[1]):
        if r.WhichOneof("record_type") == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    assert config["learning_rate"] == 0.001 and config["resolved"]["world size"] == 1
    assert config["init_from"] == "resume"


@pytest.mark.slow   # wandb.init starts W&B's service process (wandb-core)
def test_wandb_without_an_api_key_runs_offline_and_says_so(tmp_path, wandb_env, capsys):
    train.main(args(tmp_path, "--max_iters=4", "--eval_interval=2", "--wandb_log=True"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb: offline")]
    assert len(lines) == 1 and "no W&B API key" in lines[0] and "wandb sync " in lines[0]
    wandb_env.teardown()
    (folder,) = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*"))
    assert [r["_step"] for r in wandb_history(folder)] == [0, 2, 4]


@pytest.mark.slow   # wandb.init starts W&B's service process (wandb-core)
def test_wandb_dir_is_honoured_and_the_line_says_where_the_run_is(tmp_path, monkeypatch, wandb_env, capsys):
    """W&B's own WANDB_DIR (a cluster's scratch disk) takes the run, not out_dir/wandb; the offline
    line names the folder it went to."""
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    monkeypatch.setenv("WANDB_MODE", "offline")
    train.main(args(tmp_path, "--max_iters=4", "--eval_interval=2", "--wandb_log=True"))
    (folder,) = glob.glob(str(scratch / "wandb" / "offline-run-*"))
    assert not glob.glob(str(tmp_path / "out" / "wandb"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb: offline")]
    assert lines == [f"wandb: offline (WANDB_MODE=offline); the run is in {folder}: upload it with "
                     f"`wandb sync {folder}`"]
    wandb_env.teardown()   # W&B's service writes the transaction log on after run.finish(); this ends it
    assert [r["_step"] for r in wandb_history(folder)] == [0, 2, 4]


@pytest.mark.slow   # wandb.init starts W&B's service process (wandb-core)
def test_wandb_without_a_server_runs_offline_after_the_timeout(tmp_path, monkeypatch, wandb_env, capsys):
    """An API key, but the server's port refuses connections (a cluster node without internet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                      # closed again: nothing listens there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(monitor, "WANDB_TIMEOUT", 5)
    import wandb
    timeouts, init = [], wandb.init   # what W&B is told to wait, not how long this machine took
    monkeypatch.setattr(wandb, "init", lambda **kw: timeouts.append(
        (kw["settings"].init_timeout, kw["settings"].finish_timeout)) or init(**kw))
    train.main(args(tmp_path, "--max_iters=4", "--eval_interval=2", "--wandb_log=True"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb: offline")]
    assert len(lines) == 1 and "the W&B server could not be used: CommError" in lines[0], lines
    assert timeouts == [(5, 5), (5, 5)]   # the online try, then offline
    wandb_env.teardown()
    (folder,) = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*"))
    assert [r["_step"] for r in wandb_history(folder)] == [0, 2, 4]


@pytest.mark.parametrize("key, module, install", [("--tensorboard_dir=tb", "torch.utils.tensorboard",
                                                   "pip install tensorboard==2.21.0"),
                                                  ("--wandb_log=True", "wandb", "pip install wandb==0.31.0")])
def test_a_missing_package_is_one_line_naming_the_install(tmp_path, monkeypatch, key, module, install):
    monkeypatch.setitem(sys.modules, module, None)      # import fails as if it were not installed
    with pytest.raises(UserError, match=install) as e:
        train.main(args(tmp_path, "--max_iters=2", key))
    assert "\n" not in str(e.value)


def test_an_unwritable_tensorboard_dir_is_one_line(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard==2.21.0 (requirements-test.txt)")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="tensorboard_dir=.* cannot be written"):
        train.main(args(tmp_path, "--max_iters=2", f"--tensorboard_dir={tmp_path / 'file' / 'tb'}"))


def test_tracking_is_off_by_default_and_the_keys_are_runtime_keys(tmp_path):
    from stepgpt.checkpoint import RUNTIME_KEYS
    from stepgpt.config import load_config
    cfg = load_config([])
    assert not cfg.tensorboard_dir and not cfg.wandb_log
    assert {"tensorboard_dir", "wandb_log", "wandb_project", "wandb_run_name"} <= RUNTIME_KEYS
    with pytest.raises(UserError, match="wandb_project"):
        load_config(["--wandb_project=a/b"])


def test_the_docs_table_of_recorded_keys_is_what_a_run_records(tmp_path):
    """docs/tracking.md's table against a 3-stage run with ReLoRA restarts: every key a record holds
    is a row and every row a key; the log keys in every log record; the eval keys in every eval
    record; the merge keys at each growth after the first (4: no adapters yet; 8) and each restart
    (6, 10); mfu and cuda_max_allocated null on CPU, as the table says."""
    import os
    import re
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "tracking.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|$", page, re.M)
    when, last = {}, None
    for names, at in rows:
        last = last if at.strip() == '"' else at.strip()
        when.update({n: last for n in re.findall(r"`(\w+)`", names)})
    train.main(args(tmp_path, "--stage_layers=[1, 1, 1]", "--max_iters=12", "--eval_interval=4",
                    "--log_interval=2", "--relora_every=2"))
    records = metrics(tmp_path)
    assert set(when) == {k for m in records for k in m} - {"step"}
    log = {k for k, w in when.items() if w.startswith("every `log_interval`")}
    evals = {k for k, w in when.items() if w.startswith("every `eval_interval`")}
    merges = {k for k, w in when.items() if w.startswith("each growth after the first")}
    assert when["stage"] == "every record" and log and evals and merges
    assert all(log | {"stage"} == set(m) - {"step"} for m in records if "loss" in m)
    assert [m["step"] for m in records if "loss" in m] == list(range(2, 13, 2))
    assert all(evals | {"stage"} == set(m) - {"step"} for m in records if "val_loss" in m)
    assert [m["step"] for m in records if "val_loss" in m] == [0, 4, 8, 12]
    assert [m["step"] for m in records if merges <= set(m)] == [6, 8, 10]
    assert all(m["mfu"] is None and m["cuda_max_allocated"] is None for m in records if "loss" in m)
