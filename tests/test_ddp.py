"""DDP with torchrun on 2 CPU ranks (gloo): the same config on 1 process and on 2 ranks is the same
run, ranks never diverge, checkpoints move between world sizes, ZeRO-1 changes nothing but memory,
and every shipped config's accumulation pattern runs. What this cannot test here: NCCL on GPUs."""
import json
import os
import shlex
import socket
import subprocess
import sys

import pytest
import torch

from stepgpt.checkpoint import load_checkpoint
from stepgpt.config import load_config
from tests.helpers import HANG, write_dataset

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 micro-steps per rank on 2 ranks (4 in all), a growth at step 6, ReLoRA restarts at 8 and 10
# fp32: the equalities below are fp32's; dtype=auto would pick bf16 autocast on a CPU that computes bf16
# natively, whose rounding differs with each rank's share (tests/test_gpu_decisions.py holds bf16 to fp32)
TINY = ["--device=cpu", "--dtype=float32",
        "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2", "--lora_rank=4",
        "--eval_iters=3", "--log_interval=1", "--sample_tokens=0", "--warmup_iters=2",
        "--stage_warmup_iters=2", "--stage_layers=[1, 1]", "--max_iters=12", "--eval_interval=4",
        "--relora_every=2",
        "--gradient_accumulation_steps=4", "--sync_check_every=1"]


def launch(out, data, *extra, nproc=1, script="train.py", timeout=HANG):
    """train.py (or a wrapper script) on 1 process, or under torchrun on `nproc` gloo ranks."""
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable])
    proc = subprocess.run(cmd + [script, *TINY, f"--data_dir={data}", f"--out_dir={out}", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def final_val(out):
    return load_checkpoint(str(out))["best_val_loss"], load_checkpoint(str(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One straight run on 1 process and one on 2 ranks, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("ddp")
    data = write_dataset(tmp / "data")
    ok(launch(tmp / "one", data))
    two = ok(launch(tmp / "two", data, nproc=2))
    return tmp, data, two


def assert_same_run(a, b, atol):
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert ca["iter_num"] == cb["iter_num"] == 12
    assert abs(ca["best_val_loss"] - cb["best_val_loss"]) < 1e-3
    assert ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        torch.testing.assert_close(ca["model"][k].float(), cb["model"][k].float(), atol=atol, rtol=0, msg=k)


def test_two_ranks_compute_what_one_process_computes(runs):
    tmp, _, two = runs
    assert "world size : 2" in two and two.count("== stage 2/2") == 1 and two.count("ReLoRA restart") == 2
    assert_same_run(tmp / "one", tmp / "two", atol=1e-4)


def test_checkpoints_move_between_world_sizes(runs):
    """One process, then two ranks. The other way (two ranks, then one process) is
    test_zero1_computes_the_same_run's resume, and the README's two-node run resumed on one
    process in test_the_readmes_two_node_commands_run_as_two_nodes_on_localhost."""
    tmp, data, _ = runs
    ok(launch(tmp / "one-then-two", data, "--stop_at=5"))
    ok(launch(tmp / "one-then-two", data, "--init_from=resume", nproc=2))
    assert_same_run(tmp / "one", tmp / "one-then-two", atol=1e-4)


def test_zero1_computes_the_same_run(runs):
    tmp, data, _ = runs
    out = ok(launch(tmp / "zero1", data, "--zero1=True", nproc=2))
    assert "zero1 : True" in out
    assert_same_run(tmp / "two", tmp / "zero1", atol=0)                 # AdamW is elementwise: bit for bit
    # a ZeRO-1 checkpoint holds the full optimizer state, so it resumes without ZeRO too
    ok(launch(tmp / "zero1-resumed", data, "--zero1=True", "--stop_at=7", nproc=2))
    ok(launch(tmp / "zero1-resumed", data, "--init_from=resume"))
    assert_same_run(tmp / "one", tmp / "zero1-resumed", atol=1e-4)


def assert_close_muon_run(a, b):
    """Two runs of optimizer=muon on different world sizes, as close as Muon's bf16 Newton-Schulz lets
    them be: DDP's all-reduce sums in another order, and each bf16 rounding that flips moves a weight
    by ~2^-8 of a step. Measured (this box, the runs below): 4.6e-4 at most, 48 of 10k int8 entries
    one apart after the merges, the val loss 2e-6 apart; one process under ATEN_CPU_CAPABILITY=default
    against avx2 differs by 1.6e-3 and 3,879 entries. The bound: a tenth of muon_lr (an orthogonalised
    step moves an entry by about lr), 1 % of the int8 entries one apart, the val loss 1e-4."""
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert ca["iter_num"] == cb["iter_num"] == 12 and abs(ca["best_val_loss"] - cb["best_val_loss"]) < 1e-4
    flipped, stored = 0, 0
    for k, x in ca["model"].items():
        if x.is_floating_point():
            torch.testing.assert_close(x, cb["model"][k], atol=2e-3, rtol=0, msg=k)
        else:
            assert (x.int() - cb["model"][k].int()).abs().max() <= 1, k
            flipped, stored = flipped + (x != cb["model"][k]).sum().item(), stored + x.numel()
    assert flipped <= 0.01 * stored
    assert ca["optimizer"]["state"].keys() == cb["optimizer"]["state"].keys()


def test_muon_on_two_ranks_is_the_one_process_run_and_zero1_changes_nothing_but_memory(runs):
    """optimizer=muon through the growth and ReLoRA restarts: 2 ranks (DDP) against one process
    (assert_close_muon_run); ZeRO-1 (each rank runs Newton-Schulz on its own whole matrices), stopped
    and resumed, is DDP's run bit for bit; its checkpoint (the whole state) resumes on one process."""
    import shutil
    tmp, data, _ = runs
    ok(launch(tmp / "muon-one", data, "--optimizer=muon"))
    ok(launch(tmp / "muon-two", data, "--optimizer=muon", nproc=2))
    assert_close_muon_run(tmp / "muon-one", tmp / "muon-two")
    out = ok(launch(tmp / "muon-zero1", data, "--optimizer=muon", "--zero1=True", "--stop_at=7", nproc=2))
    assert "zero1 : True" in out
    shutil.copytree(tmp / "muon-zero1", tmp / "muon-zero1-then-one")
    ok(launch(tmp / "muon-zero1", data, "--optimizer=muon", "--zero1=True", "--init_from=resume", nproc=2))
    assert_same_run(tmp / "muon-two", tmp / "muon-zero1", atol=0)
    ok(launch(tmp / "muon-zero1-then-one", data, "--optimizer=muon", "--init_from=resume"))
    assert_close_muon_run(tmp / "muon-one", tmp / "muon-zero1-then-one")


def test_diverged_ranks_are_stopped_with_a_clear_error(runs, tmp_path):
    """A growth that goes differently on rank 1 (as a rank-local RNG once made ReLoRA's restarts do)."""
    _, data, _ = runs
    wrapper = tmp_path / "diverge.py"
    wrapper.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import grow, train\n"
        "real = grow.next_stage\n"
        "def next_stage(model, *a, **k):\n"
        "    out = real(model, *a, **k)\n"
        "    if os.environ['RANK'] == '1':\n"
        "        with torch.no_grad():\n"
        "            model.layers[0].attn.q.weight_scale[0] *= 1.0001\n"
        "    return out\n"
        "grow.next_stage = next_stage\n"
        "train.main(sys.argv[1:])\n")
    proc = launch(tmp_path / "out", data, nproc=2, script=str(wrapper))
    assert proc.returncode != 0
    assert "ranks [1] hold other weights than rank 0 after the growth at step 6" in proc.stderr


@pytest.mark.parametrize("name", ["step_small", "step_350m", "step_1b", "step_7b"])
def test_shipped_config_accumulation_pattern_on_two_ranks(name, runs, tmp_path):
    """Each config's micro-steps per rank at the world size the README runs it with (8 GPUs for
    350M and 1B, 1 process for small), here on 2 ranks; the model scaled down, eval_iters below the
    world size (a rank with no eval batch once hung the collectives). The vanilla twins are their
    STEP configs in one stage, with the same accumulation and keys (tests/test_config.py checks
    that); a one-stage run on 2 ranks is test_two_ranks_compute_what_one_process_computes's first
    stage and these runs' first stages."""
    _, data, _ = runs
    cfg = load_config([os.path.join(ROOT, "config", f"{name}.py")])
    per_rank = max(1, cfg.gradient_accumulation_steps // (8 if "small" not in name else 1))
    tokens = 2 * 16 * 2 * per_rank * 2                            # two iterations per stage
    stages = len(cfg.stage_layers) or (cfg.n_stages if cfg.target_layers else 1)
    depth = dict(target_layers=3 * stages) if cfg.target_layers else dict(stage_layers=[1] * stages)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
         f"config/{name}.py", "--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64",
         "--block_size=16",
         "--batch_size=2", "--lora_rank=4", "--vocab_size=0", f"--data_dir={data}", f"--out_dir={tmp_path}",
         "--eval_iters=1", "--eval_interval=2", "--log_interval=1", "--sample_tokens=0", "--warmup_iters=1",
         "--stage_warmup_iters=1", f"--gradient_accumulation_steps={2 * per_rank}",
         f"--stage_tokens={[tokens] * stages}",
         *[f"--{k}={v}" for k, v in depth.items()]],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert load_checkpoint(str(tmp_path))["iter_num"] == 2 * stages


def readme_commands():
    """The commands of docs/distributed.md's first block, as argument lists (continuation
    lines joined, comments dropped)."""
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    block = text.split("# Many GPUs, many days", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_the_readmes_two_node_commands_run_as_two_nodes_on_localhost(tmp_path):
    """The README's two torchrun commands (c10d rendezvous), node ranks 0 and 1 as two processes on
    this machine, one rank each, scaled down in size only (the model, the batch, the token budget and
    the schedule's lengths), stopped in stage 2; the page's command after a pre-emption (the plain
    one-process command: it continues the run) ends the run where one process's run ends, with the
    same evals."""
    commands = readme_commands()
    nodes = [c for c in commands if "--nnodes=2" in c]
    resume = next(c for c in commands if c[0] == "python")   # the same command continues a run
    assert [[a for a in c if a.startswith("--node_rank")] for c in nodes] == [["--node_rank=0"],
                                                                              ["--node_rank=1"]], nodes
    assert all("--rdzv_endpoint=HOST0:29500" in c and "--nproc_per_node=8" in c for c in nodes), nodes
    data = write_dataset(tmp_path / "data")
    # 512 tokens per step (gradient_accumulation_steps stays the config's 16: 8 micro-steps per node),
    # 6 steps per stage, the growth at step 6, evals at 0, 4, 8, 12
    size = ["--vocab_size=0", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16",
            "--lora_rank=4", "--lora_alpha=8.0", "--target_layers=4", "--batch_size=2",
            "--stage_tokens=[3072, 3072]", "--warmup_iters=2", "--stage_warmup_iters=2", "--eval_interval=4",
            "--eval_iters=4", "--log_interval=1", "--sample_tokens=0", f"--data_dir={data}",
            "--dtype=float32"]   # fp32, as TINY

    def two_nodes(out, *extra):
        extra = (f"--out_dir={out}", *extra)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        try:
            for command in nodes:   # torchrun's arguments: this machine's address, one process
                torchrun = [a.replace("HOST0:29500", f"127.0.0.1:{port}") for a in command[1:]]
                torchrun = [a.replace("--nproc_per_node=8", "--nproc_per_node=1") for a in torchrun]
                cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, *size, *extra]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            outs = [p.communicate(timeout=HANG) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
        return "".join(o for o, _ in outs)

    def one_process(command, out):
        return ok(subprocess.run([sys.executable, *command[1:], *size, f"--out_dir={out}"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=HANG))

    one = one_process(resume, tmp_path / "one")   # python train.py CONFIG: the run, straight
    # the two nodes stop in stage 2 (after the growth at step 6 and the eval at 8); one process ends
    # the run: the same run as one process's, its evals those of one process
    two = two_nodes(tmp_path / "two-then-one", "--stop_at=8")
    assert "world size : 1" in one and "world size : 2" in two and two.count("== stage 2/2") == 1
    assert load_checkpoint(str(tmp_path / "two-then-one"))["iter_num"] == 8
    assert "resuming from" in one_process(resume, tmp_path / "two-then-one")
    assert_same_run(tmp_path / "one", tmp_path / "two-then-one", atol=1e-4)
    val = [[m["val_loss"] for m in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "val_loss" in m]
           for run in ("one", "two-then-one")]
    assert len(val[0]) == len(val[1]) == 4 and all(abs(a - b) < 1e-3 for a, b in zip(*val)), val
