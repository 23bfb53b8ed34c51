"""optimizer=muon: torch.optim.Muon on the trained layers' matrices, AdamW on the rest (stepgpt/optim.py's
MuonAdamW), in process: one step against a float64 reference of Muon and bit for bit against torch's
own optimizers, which parameter goes where on a grown STEP model and what state carries over, a run
across a growth resumed bit for bit, the refusals, and the planner's count of its state against a
real step's allocations. Two ranks, ZeRO-1 and a kill -9: tests/test_ddp.py, tests/test_faults.py."""
import math
import os

import pytest
import torch

import grow
import train
from model import GPT, LINEARS
from stepgpt import memory, optim
from stepgpt.config import load_config
from stepgpt.errors import UserError
from tests.helpers import tiny_config, write_dataset
from tests.test_train import ROOT, args, final_state, metrics

CPU = torch.device("cpu")
STEP_SMALL = os.path.join(ROOT, "config", "step_small.py")


def muon_reference(w, grads, lr, weight_decay, momentum=0.95, coefficients=(3.4445, -4.775, 2.0315), steps=5):
    """Muon in float64, written from its definition (Keller Jordan's post and muon.py, whose update
    torch.optim.Muon implements): the momentum buffer an EMA of the gradients, the Nesterov update
    g + mu (B - g), orthogonalised by `steps` quintic Newton-Schulz iterations on the wide side after
    a Frobenius normalisation, applied at lr * sqrt(max(1, rows / cols)) after decoupled weight decay."""
    a, b, c = coefficients
    w, buf = w.double().clone(), torch.zeros_like(w, dtype=torch.float64)
    rows, cols = w.shape
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        x = (1 - momentum) * g + momentum * buf
        x = x.T if rows > cols else x
        x = x / x.norm()
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if rows > cols else x
        w = w * (1 - lr * weight_decay) - lr * math.sqrt(max(1, rows / cols)) * x
    return w


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (33, 33)])
def test_muon_steps_as_torchs_muon_and_as_its_float64_definition(shape):
    """Two steps on a ragged matrix: ours (lr = schedule x lr_scale, weight decay per step as AdamW's)
    equals torch.optim.Muon bit for bit, and a float64 Muon to bf16's precision: torch's Newton-Schulz
    runs in bf16 (8 bits of mantissa), measured 1.2-1.7 % of the two steps' largest movement here;
    a missing aspect-ratio scale (29 % at 40 x 24), another momentum or no orthogonalisation is far
    outside 3 %. The AdamW group beside it equals torch.optim.AdamW bit for bit."""
    torch.manual_seed(0)
    w0, other = torch.randn(shape), torch.randn(7, 5)
    grads = [(torch.randn(shape), torch.randn(7, 5)) for _ in range(2)]
    lr, scale, decay = 1e-3, 20.0, 0.1                  # train.py's lr, muon_lr / learning_rate, weight_decay
    ours_w, ours_o = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(other.clone())
    torch_w, torch_o = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(other.clone())
    ours = optim.MuonAdamW([{"params": [ours_w], "muon": True, "lr_scale": scale, "momentum": 0.95,
                             "weight_decay": decay / scale, "adjust_lr_fn": "original"},
                            {"params": [ours_o], "weight_decay": decay}], lr=lr, betas=(0.9, 0.95))
    muon = torch.optim.Muon([torch_w], lr=lr * scale, weight_decay=decay / scale, momentum=0.95)
    adamw = torch.optim.AdamW([torch_o], lr=lr, betas=(0.9, 0.95), weight_decay=decay)
    for g, h in grads:
        ours_w.grad, ours_o.grad, torch_w.grad, torch_o.grad = g.clone(), h.clone(), g.clone(), h.clone()
        for opt in (ours, muon, adamw):
            opt.step()
    assert torch.equal(ours_w, torch_w) and torch.equal(ours_o, torch_o)
    assert set(ours.state[ours_w]) == {"momentum_buffer"}
    assert set(ours.state[ours_o]) == {"step", "exp_avg", "exp_avg_sq"}
    ref = muon_reference(w0, [g for g, _ in grads], lr * scale, decay / scale)
    moved = (ref - w0.double()).abs().max()
    assert (ours_w.double() - ref).abs().max() < 0.03 * moved
    # its per-step shrink is AdamW's: lr * weight_decay, whatever muon_lr is
    assert (1 - lr * scale * ours.param_groups[0]["weight_decay"]) == pytest.approx(1 - lr * decay)


def grown_model(extra=()):
    """A 2-layer model trained one step with optimizer=muon, grown by one layer (STEP's transition),
    the optimizer rebuilt as enter_stage does. -> (model, old optimizer, new optimizer, state before)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=2, lora_rank=4))
    cfg = load_config(["--optimizer=muon", *extra])
    opt = train.configure_optimizer(model, cfg, CPU)
    idx = torch.randint(0, 128, (2, 16))
    model(idx, idx)[1].backward()
    opt.step()
    before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    grow.next_stage(model, 1)
    new = train.configure_optimizer(model, cfg, CPU, previous=opt, carried=grow.carried_parameters(model))
    return model, opt, new, before


@pytest.mark.parametrize("adapters", [False, True])
def test_which_parameter_muon_steps_on_a_grown_step_model_and_what_carries_over(adapters):
    """After a growth: Muon steps the new (trainable) layer's seven linear weights (and, with
    muon_adapters, the frozen layers' LoRA A and B); AdamW the embeddings, head, norms and adapters;
    nothing steps the frozen int8 store. The embeddings, head and final norm keep their AdamW state;
    the layers from stage 1, Muon's before, are frozen now and hold none."""
    model, old, new, before = grown_model(["--muon_adapters=True"] if adapters else [])
    names = dict(model.named_parameters())
    (fresh,) = [i for i in range(model.config.n_layer) if i not in model.config.frozen_layers]
    def stepped_by(muon):
        return {n for g in new.param_groups if g["muon"] == muon for n, p in names.items()
                if any(p is q for q in g["params"])}
    muon, adamw = stepped_by(True), stepped_by(False)
    expected = {f"layers.{fresh}.{lin}.weight" for lin in LINEARS}
    lora = {n for n in names if "lora_" in n}
    assert len(lora) == 2 * 7 * 2 and muon == expected | (lora if adapters else set())
    assert adamw == {n for n, p in names.items() if p.requires_grad} - muon
    assert {"wte.weight", "lm_head.weight", "norm.weight", f"layers.{fresh}.attn_norm.weight"} <= adamw
    trained_before = {n for n, s in before.items() if "momentum_buffer" in s}
    assert trained_before == {f"layers.{i}.{lin}.weight" for i in (0, 1) for lin in LINEARS}
    for n in ("wte.weight", "lm_head.weight", "norm.weight"):
        assert all(torch.equal(new.state[names[n]][k], before[n][k]) for k in before[n])
    assert all(not new.state.get(p) for n, p in names.items() if n not in ("wte.weight", "lm_head.weight",
                                                                               "norm.weight"))
    group = next(g for g in new.param_groups if g["muon"] and any(p is names[f"layers.{fresh}.attn.q.weight"]
                                                                   for p in g["params"]))
    assert group["lr_scale"] == pytest.approx(0.02 / 1e-3) and group["momentum"] == 0.95
    assert group["weight_decay"] == pytest.approx(0.1 / group["lr_scale"])   # AdamW's shrink per step
    model(torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16)))[1].backward()
    new.step()
    assert {n for n, p in names.items() if "momentum_buffer" in new.state.get(p, {})} == muon


@pytest.mark.parametrize("extra", [[], ["--muon_adapters=True", "--relora_prune=0.9"]])
def test_muon_trains_through_a_growth_and_resumes_bit_for_bit(tmp_path, extra):
    """docs/training.md's `python train.py config/step_small.py --optimizer=muon`, scaled down in size,
    across its growth and ReLoRA restarts (with muon_adapters, a partial reset of the adapters' Muon
    momentum), equals the same run stopped mid-stage and resumed: every tensor, the optimizer state,
    every logged loss. Resumed with another optimizer: one line."""
    data = write_dataset(tmp_path / "data")
    common = ["--stage_layers=[1, 1]", "--stage_tokens=[384, 384]", "--eval_interval=4", "--relora_every=4",
              "--optimizer=muon", *extra]

    def run(name, *more):   # the config file first: the sizes below override its own
        train.main([STEP_SMALL, *args(tmp_path / name, *common, *more, data=data)])
    run("a")
    run("b", "--stop_at=7")
    run("b", "--init_from=resume")
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a["iter_num"] == b["iter_num"] == 12 and len(a["config"]["stage_layers"]) == 2
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert any("momentum_buffer" in s for s in sa.values())
    assert [m["loss"] for m in metrics(tmp_path / "a") if "loss" in m] == \
           [m["loss"] for m in metrics(tmp_path / "b") if "loss" in m]
    with pytest.raises(UserError, match="holds optimizer='muon' state"):
        run("b", "--optimizer=adamw", "--init_from=resume")
    assert final_state(tmp_path / "b")["iter_num"] == 12


@pytest.mark.parametrize("argv, message", [
    (["--optimizer=muon", "--fsdp=True"], "optimizer=muon orthogonalises each matrix whole, which fsdp=True "
                                          "shards by rows: train it with DDP"),
    (["--optimizer=muon+adamw8bit"], "one optimizer per run, of adamw8bit, muon"),
    (["--optimizer=galore,muon"], "one optimizer per run, of galore, muon"),
    (["--muon_adjust_lr=moonlight"], "muon_adjust_lr='moonlight': use one of original, match_rms_adamw"),
    (["--muon_momentum=1.0"], r"muon_momentum=1.0 must be in \[0, 1\)"),
    (["--muon_lr=0"], "muon_lr=0.0 must be a finite number > 0")])
def test_muon_refusals_are_one_line_before_any_work(argv, message):
    with pytest.raises(UserError, match=message):
        load_config(argv)


def test_planned_muon_state_equals_the_allocations_of_a_real_step():
    """memory.state_bytes with Muon against what a real step allocates (the profiler's record): one
    fp32 buffer on each of Muon's matrices, AdamW's two moments on the rest; the difference is the
    tensors the plan leaves out on purpose (RoPE tables, AdamW's step counters, the input batch)."""
    from bench.peak_memory import measure_cpu_memory
    keep, extra = {}, ["--optimizer=muon"]

    def step():
        torch.manual_seed(0)
        model = GPT(tiny_config(n_layer=2, lora_rank=4))
        grow.next_stage(model, 2)
        opt = train.configure_optimizer(model, load_config(extra), CPU)
        idx = torch.randint(0, 128, (2, 16))
        model(idx, idx)[1].backward()
        opt.step()
        keep.update(model=model, opt=opt, idx=idx)

    _, live = measure_cpu_memory(step)
    model, opt = keep["model"], keep["opt"]
    planned = memory.state_bytes(model.config, optimizer="muon")
    assert memory.planned_optimizer(load_config(extra)) == "muon"
    left_out = (model.rope_cos.nbytes + model.rope_sin.nbytes + keep["idx"].nbytes
                + sum(s["step"].nbytes for s in opt.state.values() if "step" in s))
    assert live == planned + left_out
    muon = sum(a * b for a, b in memory.muon_shapes(model.config, 2, 2))
    assert planned == memory.state_bytes(model.config) - 4 * muon and muon > 0


def test_muons_state_in_eq_2_is_12_bytes_per_matrix_parameter():
    """The paper's Eq. 2 (layers only, bf16 mixed precision) with Muon: 12 B per trained matrix
    parameter (2 weight + 2 gradient + 4 master + 4 momentum), the norms and adapters at AdamW's 16;
    in our int8 accounting the same 4 B less per such parameter; ZeRO-1 divides it."""
    cfg = tiny_config(lora_rank=4)
    weights, _, norms, adapter = grow.layer_counts(cfg)
    for layers in ([3], [2, 1]):
        done, eq2 = 0, []
        for n in layers:
            eq2.append(12 * n * weights + 16 * n * norms + 2 * done * (weights + norms) + 16 * done * adapter)
            done += n
        assert grow.stage_memory(cfg, layers, memory.state_bytes, accounting="bf16", layers_only=True,
                                 optimizer="muon") == eq2
    adamw = memory.state_bytes(cfg, 2, 1)
    assert memory.state_bytes(cfg, 2, 1, optimizer="muon") == adamw - 4 * 2 * weights
    assert memory.state_bytes(cfg, 2, 1, optimizer="muon+lora") == adamw - 4 * (2 * weights + adapter)
    assert memory.state_bytes(cfg, 2, 1, optimizer="muon", zero_world=4) == \
        memory.state_bytes(cfg, 2, 1, zero_world=4) - 2 * weights


def test_plan_prints_muons_rows_and_its_per_gpu_table_without_fsdp(capsys, monkeypatch):
    """plan.py: the int8 + Muon rows below int8's, and a Muon run with zero1 gets the per-GPU table's
    DDP and ZeRO-1 rows (Muon's state divided by the ranks), no FSDP row (refused)."""
    import plan
    monkeypatch.chdir(ROOT)
    plan.main(["config/step_350m.py", "--stages", "2", "--world", "1"])
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.startswith("int8")}
    int8, muon = (float(rows[name].split()[-6]) for name in ("int8", "int8 + Muon"))   # peak GiB
    assert 0 < muon < int8
    plan.main(["config/step_350m.py", "--optimizer=muon", "--zero1=True", "--world", "4", "--stages", "2"])
    table = capsys.readouterr().out.split("per GPU on 4 ranks")[1]
    settings = [line.split()[4] for line in table.splitlines()[2:] if line.strip()]   # stage, n + f, setting
    assert settings == ["DDP", "ZeRO-1/4"] * 2 and "Muon+AdamW" in table
    ddp, zero = ([float(x) for x in line.split()[5:8]] for line in table.splitlines()[2:4])
    assert ddp[:2] == zero[:2] and zero[2] == pytest.approx(ddp[2] / 4, abs=0.01)
