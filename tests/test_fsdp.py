"""FSDP2 (fsdp=True) on 2 CPU ranks (gloo). In-process, in one 2-rank spawn shared by the quick
tests: every parameter's and AdamW state's local shard is 1/world of the whole (the frozen int8
store and its row scales included), a model built from scratch is never materialised whole and
equals GPT(cfg) from the same seed, the frozen linear receives plain tensors (int8 as stored, fp32
row scales under the bf16 policy), a compiled block has no graph break, a checkpoint saved gathered or
sharded (torch.distributed.checkpoint) holds the same; then, on the same two ranks, train.py with the
docs' sharded-checkpoint command, resumed under FSDP and DDP, refusing damaged folders. Under
torchrun (slow): the same run as one process through a growth and ReLoRA restarts, an FSDP
checkpoint resumed on one process, kill -9 of the whole job then the same command to the bit-exact
end, a sharded folder written as one file (tools/dcp_to_file.py), and docs/distributed.md's command
as written, scaled down in size only. Checkpoints that move between world sizes and between FSDP
and DDP, and faults inside a sharded save: tests/test_elastic.py."""
import functools
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

import grow
from model import GPT, GPTConfig
from stepgpt import sharding
from stepgpt.checkpoint import checkpoint_files, load_checkpoint
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import ASKED, CRAFT, HANG, REFUSED_FILE, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
# 6 layers of 32 wide: the largest tensor (the 64 x 32 embedding) is a small part of the whole
CFG = GPTConfig(vocab_size=64, n_layer=6, n_head=2, n_embd=32, ffn_hidden=64, block_size=16, lora_rank=4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows_ok(local, whole):
    """A shard is 1/world of its tensor's rows, give or take one (torch.chunk's split)."""
    return abs(local.shape[0] - whole.shape[0] / WORLD) < 1 and local.shape[1:] == whole.shape[1:]


def cpu_peak(fn):
    """The peak of the CPU tensor bytes fn() allocates (bench/peak_memory.py's allocation timeline)."""
    from bench.peak_memory import cpu_allocation_timeline
    return max(live for _, live in cpu_allocation_timeline(fn))


def _rank_checks(rank, ports, out, runs):
    """Everything the slow in-process tests assert, measured on one rank; rank 0 pickles what both
    found into `out`. Then train.py itself on these two ranks (_sharded_runs)."""
    from torch.distributed.tensor import DTensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    run = SimpleNamespace(device=torch.device("cpu"), world=WORLD, rank=rank, master=rank == 0,
                          dtype="float32", compiled=False, cfg=SimpleNamespace(eval_iters=2, eval_tokens=0))
    found = {}
    # built from scratch on the meta device and materialised shard by shard
    torch.manual_seed(3)
    built = []
    peak = cpu_peak(lambda: built.append(sharding.new_model(run, CFG)))
    model = built[0]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())   # global sizes
    found["build peak / whole"] = peak / whole
    found["one process's build peak / whole"] = cpu_peak(lambda: GPT(CFG)) / whole   # the meter's control
    state = sharding.full_state(model)
    if rank == 0:
        torch.manual_seed(3)
        reference = GPT(CFG).state_dict()
        found["init equals one process"] = (state.keys() == reference.keys()
                                            and all(torch.equal(state[k], reference[k]) for k in state))
    # a stage boundary (grow 2 layers, freeze 6) on each rank's rows, then sharded anew
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(rank))
    model(idx, idx)[1].backward()
    opt.step()
    grown = []
    found["peak of a boundary / whole"] = cpu_peak(lambda: grown.append(
        sharding.next_stage(run, model, opt, lambda m: grow.next_stage(m, 2, seed=5)))) / whole
    model = grown[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(idx, idx)[1].backward()
    opt.step()
    shards = {n: (p.to_local(), p) for n, p in model.named_parameters()}
    found["every parameter a DTensor"] = all(isinstance(p, DTensor) for _, p in shards.values())
    found["parameter shards"] = {n: _rows_ok(local, p) for n, (local, p) in shards.items()}
    found["frozen store"] = {n: (str(p.dtype), p.requires_grad) for n, (_, p) in shards.items()
                             if "weight_" in n}
    found["trainable"] = [n for n, (_, p) in shards.items() if p.requires_grad]
    found["optimizer shards"] = {f"{k} of {n}": _rows_ok(v.to_local(), p) for n, (_, p) in shards.items()
                                 if p in opt.state for k, v in opt.state[p].items() if k != "step"}
    # the gathered block, as measure_layers sees it on CUDA: plain tensors, whole, int8 as stored
    block = model.layers[0]
    block.unshard()
    q = block.attn.q.weight_q
    found["unsharded block"] = (type(q).__name__, tuple(q.shape), str(q.dtype))
    block.reshard()
    found["resharded"] = type(block.attn.q.weight_q).__name__
    # what the frozen linear's custom op receives in a forward, under the bf16 policy too
    import model as model_module
    seen, real = [], model_module.frozen_lora_linear

    def spy(x, q, scale, a, b, s):
        seen.append(tuple((type(t).__name__, str(t.dtype)) for t in (q, scale, a, b)))
        return real(x, q, scale, a, b, s)
    model_module.frozen_lora_linear = spy
    model(idx, idx)
    found["op inputs fp32 policy"] = sorted(set(seen))
    seen.clear()
    bf16 = sharding.from_state(SimpleNamespace(**{**vars(run), "dtype": "bfloat16"}), model.config,
                               sharding.full_state(model))
    found["policies"] = [f"{type(b.mlp.up).__name__}:{b._get_fsdp_state()._mp_policy.param_dtype}"
                         for b in bf16.layers]
    bf16.layers[0](torch.randn(2, CFG.block_size, CFG.n_embd), bf16.rope_cos, bf16.rope_sin)
    found["op inputs bf16 policy"] = sorted(set(seen))
    model_module.frozen_lora_linear = real
    # a frozen block compiled alone under FSDP: one graph, no break, the seven custom ops in it
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("eager")
    block = model.layers[0]
    block.compile(backend=backend)
    x = torch.randn(2, CFG.block_size, CFG.n_embd, requires_grad=True)
    block(x, model.rope_cos, model.rope_sin).sum().backward()
    ops = sum(g.code.count("torch.ops.step.frozen_lora_linear.default") for g in backend.graphs)
    found["compiled block"] = (backend.frame_count, dict(counters["graph_break"]), ops)
    # the replica check compares the model's structure under FSDP: a rank that grew otherwise is stopped
    from stepgpt import runtime
    config = model.config
    if rank == 1:   # as if rank 1 had frozen one layer fewer
        model.config = replace(model.config, frozen_layers=model.config.frozen_layers[:-1])
    try:
        runtime.check_replicas(run, model, "after the test's growth")
        found["replica check"] = "passed"
    except RuntimeError as e:
        found["replica check"] = str(e)
    model.config = config
    found.update(_boundary_checks(run, rank))
    found.update(_checkpoint_checks(run, rank, model, os.path.dirname(out)))
    everything = [None] * WORLD
    dist.all_gather_object(everything, found)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(everything, f)
    dist.destroy_process_group()
    _sharded_runs(rank, ports[1:], runs)


# the boundary's cases: (grow_init, grow_where, merge_rounding, train_embeddings, frozen_dtype), each value
# of each with each of the others at least once, every rounding with both stores
BOUNDARIES = [("mean", "upper", "nearest", True, "int8"), ("mean", "random", "stochastic", False, "bf16"),
              ("copy", "upper", "stochastic", True, "bf16"), ("copy", "random", "nearest", False, "int8"),
              ("zero", "upper", "stochastic", False, "int8"), ("zero", "random", "nearest", True, "bf16"),
              ("stack", "upper", "nearest", False, "bf16"), ("stack", "random", "stochastic", True, "int8")]
# 3 layers, the first frozen; 41 hidden units and rank 3 split unevenly over 2 ranks (21 + 20, 2 + 1 rows)
BCFG = replace(CFG, n_layer=3, ffn_hidden=41, lora_rank=3, frozen_layers=(0,))


def _trained(cfg, seed):
    """GPT(cfg) as if trained a while: adapters that are not zero, norms that are not ones."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.05)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def _relora(seed, model):
    model.merge_adapters("stochastic", torch.Generator().manual_seed(seed))


def _boundary_checks(run, rank):
    """Each boundary of BOUNDARIES (grow 2 layers) and a stochastic ReLoRA merge on each rank's rows,
    against grow.next_stage (merge_adapters) on the same model whole, on rank 0: {case: (every tensor
    bit for bit equal, the same config, the merge sums within rounding)}."""
    found = {}
    for i, (init, where, rounding, keep, dtype) in enumerate(BOUNDARIES + [("relora",) * 4 + ("int8",)]):
        plain = _trained(replace(BCFG, frozen_dtype=dtype, tie_embeddings=i == 7), i)   # 7: tied too
        model = sharding.from_state(run, plain.config, plain.state_dict())
        if init == "relora":
            merge = functools.partial(_relora, i)
            sharding.merge_in_place(model, merge)
        else:
            merge = functools.partial(grow.next_stage, n_new=2, init=init, where=where, seed=7 + i,
                                      train_embeddings=keep, rounding=rounding)
            model = sharding.next_stage(run, model, torch.optim.AdamW(model.parameters()), merge)
        got = sharding.full_state(model)
        if rank == 0:
            merge(plain)
            want = plain.state_dict()
            same = got.keys() == want.keys() and all(
                got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
            sums = torch.allclose(model.last_merge, plain.last_merge, rtol=1e-6)
            found[f"boundary {init} {where} {rounding} {keep} {dtype}"] = (
                same, model.config == plain.config, sums)
    return found


def _checkpoint_checks(run, rank, model, folder):
    """The same model and AdamW state saved gathered (a .pt file) and sharded (a .dcp folder, DCP),
    then each resumed on these ranks: {what: bit for bit equal}; and, on rank 0 alone (one process),
    both read whole: the same dict. Saved with fsdp_checkpoint=auto under two sizes of rank 0's RAM:
    {"paths": each save's file name}."""
    import train
    from stepgpt import checkpoint
    opt = train.configure_optimizer(model, load_config(["--fsdp=True"]), run.device)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(rank))
    model(idx, idx)[1].backward()
    opt.step()
    want, want_opt, found, paths = sharding.full_state(model), sharding.full_optimizer_state(opt), {}, {}
    for mode in ("gathered", "sharded"):
        cfg = load_config(["--fsdp=True", f"--fsdp_checkpoint={mode}", f"--out_dir={folder}/saved-{mode}"])
        os.makedirs(cfg.out_dir, exist_ok=True)
        at = SimpleNamespace(**{**vars(run), "cfg": cfg, "meta": {}, "log": SimpleNamespace(wandb_id=None)})
        torch.manual_seed(11)   # the same RNG state in both (a resume below draws from it)
        paths[mode] = checkpoint.save(at, model, opt, 7, 1.0, evaluated=True)
        _, ckpt = checkpoint.resume_checkpoint(cfg.out_dir, sharded=True)
        resumed = sharding.from_state(at, ckpt)
        resumed_opt = train.configure_optimizer(resumed, cfg, run.device)
        checkpoint.restore(ckpt, run.device, resumed, resumed_opt)
        got, got_opt = sharding.full_state(resumed), sharding.full_optimizer_state(resumed_opt)
        if rank == 0:
            found[f"{mode} resumed"] = same_dicts(got, want) and same_dicts(got_opt, want_opt)
    # fsdp_checkpoint=auto: rank 0's RAM (the others' is not asked) twice the weights and AdamW state,
    # so a quarter does not hold them (sharded), then eight times (gathered)
    nbytes, real = checkpoint._tensor_bytes([want, want_opt]) if rank == 0 else 0, checkpoint.host_memory
    for mode, ram in (("auto", 2 * nbytes), ("auto-fits", 8 * nbytes)):
        checkpoint.host_memory = lambda ram=ram: ram if rank == 0 else 0
        cfg = load_config(["--fsdp=True", f"--out_dir={folder}/saved-{mode}"])
        os.makedirs(cfg.out_dir, exist_ok=True)
        at = SimpleNamespace(**{**vars(run), "cfg": cfg, "meta": {}, "log": SimpleNamespace(wandb_id=None)})
        paths[mode] = checkpoint.save(at, model, opt, 7, 1.0, evaluated=True)
    checkpoint.host_memory = real
    if rank == 0:
        found["paths"] = {m: os.path.basename(p) for m, p in paths.items()}
        read = [checkpoint.load_checkpoint(paths[m]) for m in ("gathered", "sharded")]
        for ckpt in read:   # the keys that differ by design: where each was written, and how
            del ckpt["config"]["out_dir"], ckpt["config"]["fsdp_checkpoint"]
        found["one format"] = same_dicts(*read)
    return found


def same_dicts(a, b):
    """Two checkpoints' dicts hold the same keys and values, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_dicts(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_dicts(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _sharded_runs(rank, ports, runs):
    """train.py on these two ranks as torchrun would start it (its environment), for the docs' sharded
    checkpoint command: to the end; in a copy, resumed from the checkpoint before its last, under
    FSDP and under DDP (the command without --fsdp=True); and resumed from a copy whose newest folder
    is damaged in a file that rank 1 verifies, or crafted to run code when read (tests/helpers.py's
    CRAFT: a .pt file in its place, its header.pt, its .metadata, a pickled-bytes entry); each refusal
    written to refusal-RANK.txt."""
    import train
    from stepgpt import checkpoint
    command, out = runs
    ddp = [a for a in command if a != "--fsdp=True" and not a.startswith("--fsdp_checkpoint=")]
    previous, resume = ["--init_from=resume_previous"], ["--init_from=resume"]
    cases = [("sharded", command, []), ("sharded-resumed", command, previous), ("ddp-resumed", ddp, previous),
             ("damaged", command, resume), ("damaged-header", command, resume)]
    cases += [(f"crafted-{kind}", command, resume) for kind in CRAFT]
    for port, (name, args, extra) in zip(ports, cases):
        if rank == 0 and name != "sharded":   # the others wait for rank 0 in the process group's start
            shutil.copytree(f"{out}/sharded", f"{out}/{name}")
            newest = checkpoint.checkpoint_files(f"{out}/{name}")[0]
            if name.startswith("crafted-"):   # a finished run's newest is never loaded (it says so and stops)
                shutil.rmtree(newest)
                newest = checkpoint.checkpoint_files(f"{out}/{name}")[0]
            if name == "crafted-file":   # a file in the newest folder's place
                ckpt, newest = checkpoint.load_checkpoint(newest), newest[:-4] + ".pt"
                shutil.rmtree(newest[:-3] + ".dcp")
                checkpoint._write_file(newest, ckpt)
            if name.startswith("crafted-"):
                CRAFT[name[len("crafted-"):]](newest, f"{out}/marker-{name}")
            if name == "damaged":   # a byte of a file rank 1 hashes
                with open(f"{newest}/__0_0.distcp", "r+b") as f:
                    first = f.read(1)[0]
                    f.seek(0)
                    f.write(bytes([first ^ 0xFF]))   # same size: only its digest tells
            if name == "damaged-header":   # the zip's end, which rank 0 reads before the others hash
                with open(f"{newest}/header.pt", "r+b") as f:
                    f.seek(-22, os.SEEK_END)
                    f.write(b"\xff" * 22)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_PORT=str(port))
        sharding._mesh.cache_clear()   # a mesh of the last process group, which train.main ended
        try:
            train.main(python(args[4:], f"{out}/{name}", *extra)[1:])
        except UserError as e:
            with open(f"{out}/refusal-{rank}.txt", "a") as f:
                f.write(f"{name}: {e}\n")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """_rank_checks on 2 gloo ranks (a spawn: slow): what each rank found, and the folder of the
    sharded runs."""
    tmp = tmp_path_factory.mktemp("fsdp")
    data = write_dataset(tmp / "data", vocab=300)
    runs = (sharded_command() + [f"--data_dir={data}"], str(tmp))
    ports = [_free_port() for _ in range(10)]
    torch.multiprocessing.spawn(_rank_checks, args=(ports, str(tmp / "found.pkl"), runs), nprocs=WORLD)
    with open(tmp / "found.pkl", "rb") as f:
        return pickle.load(f), tmp


@pytest.fixture(scope="module")
def ranks(spawned):
    return spawned[0]


@pytest.mark.slow
def test_every_shard_is_one_rank_s_share_the_frozen_int8_store_and_the_optimizer_state_included(ranks):
    for found in ranks:
        assert found["every parameter a DTensor"]
        shards = found["parameter shards"]
        assert len(shards) > 100 and all(shards.values()), shards
        store = found["frozen store"]   # 6 frozen layers of 7 linears: int8 and fp32 scales, no gradient
        assert len(store) == 6 * 7 * 2
        assert set(store.values()) == {("torch.int8", False), ("torch.float32", False)}
        opt = found["optimizer shards"]   # AdamW's two moments of every trainable tensor
        assert len(opt) == 2 * len(found["trainable"]) and all(opt.values()), opt


@pytest.mark.slow
def test_a_model_built_from_scratch_is_never_whole_on_a_rank_and_equals_one_process_s(ranks):
    """The CPU allocator's peak while each rank builds its shards: its half, plus one whole tensor
    at a time; building the same model on one process peaks at all of it (the meter's control)."""
    for found in ranks:
        assert found["build peak / whole"] < 0.7, found["build peak / whole"]
        assert found["one process's build peak / whole"] >= 1.0
    assert ranks[0]["init equals one process"]   # GPT(cfg) from the same seed, tensor for tensor


@pytest.mark.slow
def test_a_boundary_on_each_rank_s_rows_equals_one_process_s_bit_for_bit(ranks):
    """grow.next_stage run on each rank's own rows (sharding.next_stage) gives, gathered, what it
    gives on the whole model: every init, both placements and roundings, with and without
    train_embeddings, the int8 and bf16 stores; and a ReLoRA merge in place. No rank gathers the
    model: each peaks below the whole model (the gathered path held all of it on rank 0)."""
    cases = {k: v for k, v in ranks[0].items() if k.startswith("boundary ")}
    assert len(cases) == len(BOUNDARIES) + 1 and all(v == (True, True, True) for v in cases.values()), cases
    for found in ranks:
        assert found["peak of a boundary / whole"] < 0.75, found["peak of a boundary / whole"]


@pytest.mark.slow
def test_a_checkpoint_gathered_or_sharded_holds_the_same_and_resumes_bit_for_bit(ranks):
    """One model and AdamW state saved both ways: each resumes on 2 ranks to every bit of both;
    read whole on one process, the .pt file and the .dcp folder give the same dict."""
    found = ranks[0]
    assert found["paths"] == {"gathered": "ckpt-00000007.pt", "sharded": "ckpt-00000007.dcp",
                              "auto": "ckpt-00000007.dcp", "auto-fits": "ckpt-00000007.pt"}
    assert found["gathered resumed"] and found["sharded resumed"] and found["one format"]


@pytest.mark.slow
def test_the_docs_sharded_command_writes_folders_that_resume_bit_for_bit(spawned):
    """docs/distributed.md's sharded-checkpoint command (train.py on 2 ranks, scaled down): the
    newest two checkpoints are folders, each rank's file, the header and the manifest in each; the
    run resumed from the one before its last (--init_from=resume_previous) ends bit for bit where
    it ended."""
    _, tmp = spawned
    out = tmp / "sharded"
    names = [os.path.basename(p) for p in checkpoint_files(str(out))]
    assert names == ["ckpt-00000012.dcp", "ckpt-00000010.dcp"]
    for folder in checkpoint_files(str(out)):
        assert sorted(os.listdir(folder)) == [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp",
                                              "header.pt"]
    assert os.path.isdir(tmp / "sharded-resumed" / "ckpt-00000012.dcp.superseded")
    same_tensors(tmp / "sharded-resumed", out, exact=True)
    assert (out / "sample.txt").read_text()


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_under_ddp(spawned):
    """The docs' sharded run resumed from its checkpoint before the last (a .dcp folder) under DDP on
    the same 2 ranks: each rank reads it whole, trains to the end and writes a .pt file, which holds
    what the sharded run ended with (within float tolerance: another reduction order)."""
    _, tmp = spawned
    out = tmp / "ddp-resumed"
    assert [os.path.basename(p) for p in checkpoint_files(str(out))] == ["ckpt-00000012.pt",
                                                                         "ckpt-00000010.dcp"]
    assert load_checkpoint(str(out))["config"]["fsdp"] is False
    same_tensors(out, tmp / "sharded", exact=False)


@pytest.mark.slow
def test_a_damaged_checkpoint_folder_stops_every_rank_naming_the_one_before_it(spawned):
    """A byte changed in the newest folder's file that rank 1 hashes, or the end of its header (which
    rank 0 reads and so hashes itself): both ranks refuse the resume in one line before any
    training, naming the checkpoint before it."""
    _, tmp = spawned
    for rank in range(WORLD):
        refusals = (tmp / f"refusal-{rank}.txt").read_text().splitlines()
        refusals = [line for line in refusals if line.startswith("damaged")]
        assert [line.split(":")[0] for line in refusals] == ["damaged", "damaged-header"], refusals
        for line, file in zip(refusals, ("__0_0.distcp", "header.pt")):
            folder = tmp / line.split(":")[0]
            assert line.split(": ", 1)[1] == (
                f"checkpoint {folder}/ckpt-00000012.dcp is unusable (checksum mismatch in {file}: the folder "
                f"is damaged); resume from the one before it, {folder}/ckpt-00000010.dcp, with "
                f"--init_from=resume_previous"), line


@pytest.mark.slow
def test_a_crafted_checkpoint_stops_every_rank_in_one_line_and_runs_nothing(spawned):
    """The docs' sharded run resumed on its 2 ranks from a copy whose newest checkpoint (mid-run: the
    final one removed) was built to run code when read (a .pt file, a folder's header.pt or .metadata,
    or a .metadata declaring a tensor as pickled bytes): every rank refuses it in one line naming the
    file and what it asked for, before any training; the code never runs (no marker) and no
    checkpoint is written."""
    _, tmp = spawned
    for rank in range(WORLD):
        refusals = [line for line in (tmp / f"refusal-{rank}.txt").read_text().splitlines()
                    if line.startswith("crafted-")]
        assert [line.split(":")[0] for line in refusals] == [f"crafted-{kind}" for kind in CRAFT], refusals
        for line, kind in zip(refusals, CRAFT):
            newest = tmp / f"crafted-{kind}" / ("ckpt-00000010.pt" if kind == "file" else "ckpt-00000010.dcp")
            assert line.split(": ", 1)[1].startswith(
                f"checkpoint {newest}{REFUSED_FILE[kind]} {ASKED[kind]}: "), line
    for kind in CRAFT:
        assert not (tmp / f"marker-crafted-{kind}").exists()
        assert [os.path.basename(p) for p in checkpoint_files(str(tmp / f"crafted-{kind}"))] == [
            "ckpt-00000010.pt" if kind == "file" else "ckpt-00000010.dcp"]


def the_tools_read(ckpt, tmp, capsys):
    """sample.py, grow.py and export_hf.py, in-process on one process, each read checkpoint `ckpt`
    (a run folder: its newest checkpoint) into tmp/grown.pt and tmp/hf."""
    import export_hf
    import sample
    capsys.readouterr()
    sample.main([f"--ckpt={ckpt}", "--max_new_tokens=10", "--prompt=To be", "--device=cpu"])
    assert capsys.readouterr().out.startswith("To be")
    grow.main([ckpt, "--add=1", "--freeze", f"--out={tmp / 'grown.pt'}"])
    assert load_checkpoint(str(tmp / "grown.pt"))["model_args"]["n_layer"] == 3
    pytest.importorskip("safetensors")
    export_hf.main([ckpt, str(tmp / "hf")])
    assert (tmp / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_process_and_the_tools_read_it(spawned, capsys):
    """The sharded run's checkpoint before its last resumed on one process (another world size:
    each tensor read whole) to the end; a save that a kill interrupted (its temp folder) is removed
    on the way; a truncated folder is refused naming the one before it; sample.py, grow.py and
    export_hf.py read a folder."""
    import train
    _, tmp = spawned
    one = tmp / "sharded-one"
    shutil.copytree(tmp / "sharded", one)
    os.makedirs(one / "ckpt-00000014.dcp.tmp")
    command = single(sharded_command())
    train.main(python(command[1:], one, f"--data_dir={tmp / 'data'}", "--init_from=resume_previous")[1:])
    assert not os.path.exists(one / "ckpt-00000014.dcp.tmp")
    assert checkpoint_files(str(one))[0] == str(one / "ckpt-00000012.pt")   # one process writes a file
    same_tensors(one, tmp / "sharded", exact=False)
    the_tools_read(str(tmp / "sharded"), tmp, capsys)   # its newest checkpoint: a .dcp folder
    truncated = tmp / "truncated"
    shutil.copytree(tmp / "sharded", truncated)
    newest, before = checkpoint_files(str(truncated))
    with open(os.path.join(newest, "__1_0.distcp"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError) as e:
        load_checkpoint(str(truncated))
    assert re.fullmatch(re.escape(f"the newest checkpoint of {truncated}, {newest}, is unusable "
                                  f"(__1_0.distcp is 100 bytes, not ") + r"\d+" + re.escape(
        f": the folder is truncated or damaged); the one before it is {before}: pass that file, or remove "
        f"the unusable one"), str(e.value)), str(e.value)


@pytest.mark.slow
def test_a_sharded_checkpoint_becomes_one_file_that_holds_the_same(spawned, capsys):
    """docs/distributed.md's tools/dcp_to_file.py, in-process: the sharded run's newest folder (the
    run folder given) written as one checkpoint file, which load_checkpoint verifies and reads into
    the same dict as the folder, no temp file left; an existing --out, a damaged folder and a run
    whose newest is a .pt are refused in one line, nothing written."""
    from tools import dcp_to_file
    _, tmp = spawned
    page = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    (line,) = re.findall(r"^(python tools/dcp_to_file\.py .*)$", page, re.M)
    argv = shlex.split(line, comments=True)
    assert argv[:2] == ["python", "tools/dcp_to_file.py"] and argv[3] == "--out", argv
    out, folder = tmp / "one-file.pt", checkpoint_files(str(tmp / "sharded"))[0]
    capsys.readouterr()
    dcp_to_file.main([str(tmp / "sharded"), "--out", str(out)])
    assert capsys.readouterr().out.startswith(f"wrote {out} (") and folder.endswith(".dcp")
    assert same_dicts(load_checkpoint(str(out)), load_checkpoint(folder))
    assert sorted(os.listdir(tmp)).count("one-file.pt.tmp") == 0
    for bad, says in ((tmp / "sharded", "exists"), (tmp / "damaged", "checksum mismatch in __0_0.distcp"),
                      (tmp / "ddp-resumed", "is not a .dcp checkpoint folder")):
        with pytest.raises(UserError) as e:
            dcp_to_file.main([str(bad), "--out", str(out if says == "exists" else tmp / "refused.pt")])
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not os.path.exists(tmp / "refused.pt")


@pytest.mark.slow
def test_the_frozen_linear_gets_plain_tensors_int8_as_stored_and_fp32_scales_under_bf16(ranks):
    plain = [(("Parameter", "torch.int8"),) + (("Parameter", "torch.float32"),) * 3]
    for found in ranks:
        assert found["op inputs fp32 policy"] == plain
        assert found["op inputs bf16 policy"] == plain      # a frozen block's policy casts nothing
        # bf16 units: the trainable blocks (the growth put its two new layers at 5 and 7)
        assert found["policies"] == ["FrozenLoRALinear:None"] * 5 + ["Linear:torch.bfloat16",
                                                                      "FrozenLoRALinear:None",
                                                                      "Linear:torch.bfloat16"]
        # what measure_layers sees on CUDA between unshard() and reshard()
        assert found["unsharded block"] == ("Parameter", (32, 32), "torch.int8")
        assert found["resharded"] == "DTensor"


@pytest.mark.slow
def test_a_block_compiled_alone_under_fsdp_has_no_graph_break(ranks):
    for found in ranks:
        frames, breaks, ops = found["compiled block"]
        assert frames == 1 and breaks == {} and ops == 7


@pytest.mark.slow
def test_the_replica_check_stops_ranks_that_hold_another_model(ranks):
    for found in ranks:
        assert found["replica check"].startswith("ranks [1] hold another model than rank 0 after the test's "
                                                 "growth")


# ---------------------------------------------------------------------------------------------
# in-process (the quick run)

@pytest.mark.parametrize("kw", [dict(frozen_layers=(0, 2)), dict(frozen_layers=(1,), frozen_dtype="bf16"),
                                dict(frozen_layers=(0,), tie_embeddings=True, train_embeddings=False)])
def test_the_meta_skeleton_is_gpt_s_tree(kw):
    torch.manual_seed(0)
    cfg = replace(CFG, n_layer=3, **kw)
    model = GPT(cfg)
    skeleton = sharding.skeleton(cfg)
    assert all(p.is_meta for p in skeleton.parameters())
    tree = lambda m: [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()]  # noqa: E731
    assert tree(skeleton) == tree(model) and skeleton.config == model.config
    assert (skeleton.lm_head.weight is skeleton.wte.weight) == cfg.tie_embeddings


def test_fsdp_with_zero1_another_optimizer_or_without_torchrun_is_refused_in_one_line(tmp_path):
    import train
    with pytest.raises(UserError, match="fsdp=True shards the AdamW state already .* use one of them"):
        load_config(["--fsdp=True", "--zero1=True"])
    with pytest.raises(UserError, match="fsdp=True runs optimizer=adamw with relora_prune=1"):
        load_config(["--fsdp=True", "--optimizer=galore"])
    with pytest.raises(UserError, match="fsdp=True runs optimizer=adamw with relora_prune=1"):
        load_config(["--fsdp=True", "--relora_prune=0.9"])
    data = write_dataset(tmp_path / "data")
    with pytest.raises(UserError, match=r"fsdp=True shards the model over torchrun's ranks: start it with "
                                        r"torchrun --nproc_per_node=N"):
        train.main(["--fsdp=True", f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--device=cpu",
                    "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--max_iters=2",
                    "--sample_tokens=0"])


# ---------------------------------------------------------------------------------------------
# torchrun (slow): docs/distributed.md's command, cross-mode resumes, signals

# the docs' step_small command scaled down in size only: the model, the batch, the token budget, the
# schedule's lengths, the eval and the sample; 64 tokens per step, 6 steps per stage, growth at 6
# fp32: the equalities below are fp32's; dtype=auto would pick bf16 autocast on a CPU that computes bf16
# natively, whose rounding differs with each rank's share (tests/test_gpu_decisions.py holds bf16 to fp32)
SIZE = ["--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2", "--lora_rank=4",
        "--stage_layers=[1, 1]", "--stage_tokens=[384, 384]", "--warmup_iters=2", "--stage_warmup_iters=2",
        "--eval_interval=2", "--eval_iters=4", "--log_interval=1", "--sample_tokens=20", "--dtype=float32"]


def docs_command(sharded=False):
    """docs/distributed.md's FSDP command (with sharded checkpoints), as an argument list."""
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    lines = [line for line in re.findall(r"^(torchrun .*--fsdp=True.*)$", text, re.M)
             if ("--fsdp_checkpoint=sharded" in line) == sharded]
    assert len(set(lines)) == 1, lines
    return shlex.split(lines[0], comments=True)


def sharded_command():
    return docs_command(sharded=True)


def single(command):
    """The same run on one process: python train.py CONFIG KEYS, without --fsdp=True (and its
    checkpoints' form)."""
    return [a for a in command[3:] if a != "--fsdp=True" and not a.startswith("--fsdp_checkpoint=")]


def torchrun(args, out, *extra):
    """args: a torchrun command line (docs' form); run with this Python, scaled down in size."""
    return [sys.executable, "-m", "torch.distributed.run", *args[1:], *SIZE, f"--out_dir={out}", *extra]


def python(args, out, *extra):
    return [sys.executable, *args, *SIZE, f"--out_dir={out}", *extra]


def ok(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def val_losses(out):
    records = map(json.loads, open(os.path.join(out, "metrics.jsonl")))
    return [m["val_loss"] for m in records if "val_loss" in m]


def same_tensors(a, b, exact):
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert ca["iter_num"] == cb["iter_num"] and ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        if exact:
            assert torch.equal(ca["model"][k], cb["model"][k]), k
        else:
            torch.testing.assert_close(ca["model"][k].float(), cb["model"][k].float(), rtol=0, atol=1e-4,
                                       msg=k)
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            if exact:
                assert torch.equal(sa[i][k], sb[i][k]), (i, k)
            else:
                torch.testing.assert_close(sa[i][k].float(), sb[i][k].float(), rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def docs_run(tmp_path_factory):
    """docs/distributed.md's command on 2 ranks and the same keys on one process."""
    tmp = tmp_path_factory.mktemp("fsdp-docs")
    data = write_dataset(tmp / "data", vocab=300)     # 299 BPE ranks + <|endoftext|>: a real tokenizer
    command = docs_command()
    assert command[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "train.py"], command
    fsdp = ok(torchrun(command, tmp / "fsdp", f"--data_dir={data}"))
    one = ok(python(single(command), tmp / "one", f"--data_dir={data}"))
    return tmp, data, command, fsdp, one


@pytest.mark.slow
def test_the_docs_fsdp_command_trains_through_a_growth_with_one_process_s_val_losses(docs_run):
    tmp, _, _, fsdp, one = docs_run
    assert "fsdp : True" in fsdp and "world size : 2" in fsdp and fsdp.count("== stage 2/2: grew 1") == 1
    assert "world size : 1" in one
    a, b = val_losses(tmp / "fsdp"), val_losses(tmp / "one")
    assert len(a) == len(b) == 7
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
    same_tensors(tmp / "fsdp", tmp / "one", exact=False)
    assert (tmp / "fsdp" / "sample.txt").read_text()   # sampled on both ranks, written by rank 0


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_samples_grows_and_exports_on_one_process(docs_run, capsys):
    """One format: the FSDP run's checkpoint before its last is resumed on one process to the end of
    the same run; sample.py, grow.py and export_hf.py read its final one."""
    tmp, data, command, _, _ = docs_run
    shutil.copytree(tmp / "fsdp", tmp / "fsdp-then-one")
    out = ok(python(single(command), tmp / "fsdp-then-one", f"--data_dir={data}",
                    "--init_from=resume_previous"))
    assert "world size : 1" in out and "resuming from" in out and "ckpt-00000010.pt (step 10)" in out
    same_tensors(tmp / "fsdp-then-one", tmp / "one", exact=False)
    the_tools_read(str(tmp / "fsdp"), tmp, capsys)


# a train.py whose ranks in PAUSE_RANKS pause before step PAUSE_AT + 1 (rank 0 has logged step PAUSE_AT)
# until a signal reaches them or they are killed: the test's signal lands at that step however busy
# the machine is
PAUSED = (
    "import os, sys, time\n"
    f"sys.path.insert(0, {ROOT!r})\n"
    "import train\nfrom stepgpt import errors, runtime\n"
    "at, ranks, signalled = int(os.environ['PAUSE_AT']), os.environ['PAUSE_RANKS'].split(','), []\n"
    "handle = runtime.StopRequest.handle\n"
    "def handled(self, *a):\n"
    "    handle(self, *a)\n"
    "    signalled.append(1)\n"
    "runtime.StopRequest.handle = handled\n"
    "step = train.train_step\n"
    "def paused(run, model, raw, opt, it):\n"
    "    while it == at and os.environ['RANK'] in ranks and not signalled:\n"
    "        time.sleep(0.01)\n"
    "    return step(run, model, raw, opt, it)\n"
    "train.train_step = paused\n"
    "errors.run_cli(train.main)\n")


def _paused(tmp, command):
    wrapper = tmp / "paused.py"
    wrapper.write_text(PAUSED)
    return [str(wrapper) if a == "train.py" else a for a in command]


def _start(cmd, at, ranks):
    env = {**os.environ, "PAUSE_AT": str(at), "PAUSE_RANKS": ",".join(map(str, ranks))}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if re.match(rf"step +{step}/", line):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")


def _workers(launcher):
    """{rank: pid} of torchrun's workers (each in a session of its own, so killing the launcher's
    process group would leave them running)."""
    workers = {}
    for pid in open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split():
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
        workers[rank] = int(pid)
    assert sorted(workers) == [0, 1], workers
    return workers


@pytest.mark.slow
def test_kill_minus_9_of_the_whole_job_mid_stage_then_resume_ends_bit_for_bit(docs_run):
    """FSDP killed with SIGKILL (launcher and ranks at once) mid stage 2, then the same command
    again: it continues from the last checkpoint, and the end equals the docs run's straight end,
    every tensor and AdamW moment bit for bit."""
    tmp, data, command, _, _ = docs_run
    out = tmp / "killed"
    proc = _start(torchrun(_paused(tmp, command), out, f"--data_dir={data}"), at=9, ranks=[0, 1])
    _wait_for_step(proc, 9)
    for pid in [proc.pid, *_workers(proc).values()]:   # kill -9 of the whole job, at once
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=HANG)
    assert load_checkpoint(str(out))["iter_num"] == 8   # mid stage 2 (steps 6-12)
    ok(torchrun(command, out, f"--data_dir={data}"))
    same_tensors(out, tmp / "fsdp", exact=True)


# ---------------------------------------------------------------------------------------------
# docs/distributed.md's other commands: the sharded plans and the CPU measurement

def section_commands(prefix):
    """The command lines of the FSDP section's ```bash blocks that start with `prefix`."""
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read().split("## Sharded training: FSDP2", 1)[1]
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith(prefix)]


def test_the_docs_sharded_plans_run_scaled_down_in_depth(capsys):
    """Each plan.py command of the section, with 2 layers per stage instead of the config's (the
    enumeration of 80 layers takes a minute): the per-GPU table, a DDP, ZeRO-1 and FSDP row per stage."""
    import plan
    commands = section_commands("python plan.py")
    assert [c[2] for c in commands] == ["config/vanilla_7b.py", "config/step_7b.py", "config/step_70b.py"]
    for argv in commands:
        keys = [a for a in argv[3:] if a.startswith("--") and "=" in a]
        stages = grow.stage_count(load_config([argv[2], *keys, "--fsdp=True"]))
        plan.main(argv[2:] + [f"--stage_layers={[2] * stages}"])
        out = capsys.readouterr().out
        world = argv[argv.index("--world") + 1]
        table = out.split(f"per GPU on {world} ranks, GiB", 1)[1].splitlines()[2:]
        settings = [line.split()[4] for line in table]   # stage, n, +, frozen, setting
        assert settings == ["DDP", f"ZeRO-1/{world}", f"FSDP/{world}"] * stages, out


def test_the_start_up_memory_check_is_per_rank_against_the_gpus_memory_before_the_model(monkeypatch, capsys):
    """The section's STEP 7B on 2 x 24 GB, at train.py's start on a (fake) 24 GB GPU that had 22 GiB
    free before the model was placed (7 GiB of it now held by this process's allocator): the planned
    step peak the log prints and checks is plan.py's per-GPU one for the run's setting (FSDP/2 and
    ZeRO-1/2 rows), so an FSDP run that fits does not warn; DDP's whole peak, 39.83 GiB, does, against
    the 22 GiB (not the 15 free after the model)."""
    import plan
    from torch._subclasses.fake_tensor import FakeTensorMode
    from stepgpt import monitor
    (command,) = [c for c in section_commands("python plan.py") if c[2] == "config/step_7b.py"]
    keys = [a for a in command[3:] if a.startswith("--") and "=" in a]
    world = int(command[command.index("--world") + 1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (15 * 2**30, 24 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * 2**30)
    for mode in ("fsdp", "zero1", "ddp"):
        shards = [f"--{mode}=True"] if mode != "ddp" else []
        tcfg, cfg, _, _ = plan.final_model(SimpleNamespace(rank=0, vocab=0, keys=keys + shards), command[2])
        layers = grow.stage_plan(tcfg, cfg.vocab_size, tcfg.batch_size * tcfg.block_size)[0]
        plan.sharded_table(tcfg, cfg, layers, world, 24)
        name = {"ddp": "DDP", "zero1": f"ZeRO-1/{world}", "fsdp": f"FSDP/{world}"}[mode]
        table = [float(row.split()[9]) for row in capsys.readouterr().out.splitlines() if f" {name} " in row]
        lines = []
        run = SimpleNamespace(cfg=tcfg, device=torch.device("cuda:0"), world=world, dtype="bfloat16",
                              compiled=True, data={"train": np.zeros(8), "val": np.zeros(8)},
                              meta={"vocab_size": 32000}, vocab_size=cfg.vocab_size, tokens_per_iter=1,
                              stage_layers=layers, stage_iters=[1] * len(layers),
                              depth=list(np.cumsum(layers)), log=SimpleNamespace(print=lines.append,
                                                                                 config=lambda values: None))
        with FakeTensorMode():   # the device probe's CUDA tensor, on a CPU build
            monitor.describe(run, None)
        planned = next(line for line in lines if line.startswith("planned"))
        logged = [float(v) for v in re.findall(r"stage \d+ ([\d.]+)GiB", planned.split("; step peak")[1])]
        assert logged == pytest.approx(table, abs=0.006) and len(table) == 4, (planned, table)
        per_rank = f" per rank ({name.split('/')[0]} on 2 ranks)" if mode != "ddp" else ""
        assert f"step peak{per_rank} with bfloat16 activations" in planned
        warnings = [line for line in lines if line.startswith("warning")]
        assert len(warnings) == (max(table) > 22) == (mode != "fsdp"), lines   # the docs' fit, and no other
        over = f"{max(table):.2f}GiB, is over the 22.00GiB free on cuda:0 before the model was placed"
        assert all(over in line for line in warnings), warnings


@pytest.mark.slow
def test_the_docs_cpu_measurement_of_fsdp_against_ddp_runs_scaled_down(tmp_path):
    """bench/peak_memory.py --ranks 2 as the section shows it, the model scaled down: each rank's
    peak per window under DDP and under FSDP, beside the plan."""
    (command,) = section_commands("python bench/peak_memory.py")
    data = write_dataset(tmp_path / "data")
    size = ["n_embd=32", "n_head=2", "ffn_hidden=64", "block_size=16", "batch_size=2", "lora_rank=4",
            f"data_dir={data}"]
    out = ok([sys.executable, *command[1:], *[a for s in size for a in ("--set", s)]])
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| step2 |")]
    assert [(r[1], r[2]) for r in rows] == [(s, f"{i} {p}") for s in ("DDP", "FSDP") for i in (1, 2)
                                            for p in ("stage change", "step")], out
    assert all(float(r[5].replace(",", "")) > 0 and float(r[6].replace(",", "")) > 0 for r in rows), out


def test_the_sharded_state_divides_what_ddp_holds():
    """memory.sharded_state: FSDP divides weights, gradients and AdamW state by the world size, ZeRO-1
    the AdamW state only; DDP's is the planner's whole model state (16 B per trainable parameter)."""
    from stepgpt import memory
    cfg = replace(CFG, frozen_layers=(0, 1))
    ddp = memory.sharded_state(cfg, 4, 2, 8, "ddp")
    assert sum(ddp) == memory.state_bytes(cfg, 4, 2)
    assert memory.sharded_state(cfg, 4, 2, 8, "fsdp") == tuple(b / 8 for b in ddp)
    assert memory.sharded_state(cfg, 4, 2, 8, "zero1") == (ddp[0], ddp[1], ddp[2] / 8)
    whole = memory.step_peak_bytes(cfg, 4, 2, 256)
    assert memory.step_peak_bytes(cfg, 4, 2, 256, fsdp_world=8) < whole
