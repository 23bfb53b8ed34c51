import math

import pytest
import torch

import frozen_linear
from model import GPT, FrozenLoRALinear, dense_weight, merge_quality, quantize_int8
from stepgpt import kernels
from stepgpt.kernels import frozen_lora
from stepgpt.errors import UserError
from tests.helpers import needs_interpreter, tiny_config


def test_shapes_and_initial_loss_near_ln_vocab():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    logits, loss = model(idx)
    assert logits.shape == (3, 1, cfg.vocab_size) and loss is None


def test_param_count_matches_formula():
    cfg = tiny_config(tie_embeddings=False)
    d, f, V, L = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size, cfg.n_layer
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    assert GPT(cfg).num_params() == (L * per_layer + 2 * V * d + d, 0)
    tied = GPT(tiny_config(tie_embeddings=True))
    assert tied.num_params()[0] == L * per_layer + V * d + d
    assert tied.lm_head.weight is tied.wte.weight


def test_frozen_layers_counts_and_flops():
    cfg = tiny_config(frozen_layers=(0,), lora_rank=4)
    model = GPT(cfg)
    d, f, V, r, T = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size, 4, cfg.block_size
    weights = 4 * d * d + 3 * d * f
    adapters = r * (8 * d + 3 * (d + f))
    trainable, frozen = model.num_params()
    assert frozen == weights + 2 * d               # int8 weights + the two frozen norms
    assert trainable == (weights + 2 * d) + adapters + 2 * V * d + d
    expected = 6 * V * d + 6 * weights + 4 * weights + 6 * adapters + 12 * cfg.n_layer * d * T
    assert model.estimate_flops() == expected


def test_frozen_lora_linear_backward_computes_no_weight_gradient(monkeypatch):
    """The backward of a frozen layer costs dX plus the low-rank terms, never dW: counted in matmul
    FLOPs, with an nn.Linear (which does compute dW) as the control. A dispatch mode sees the custom
    op, not the matmuls inside it, so the count runs inside the op's (reference) backward."""
    from torch.utils.flop_counter import FlopCounterMode
    inside = frozen_linear.backward
    counted = []

    def counting(*args):
        with FlopCounterMode(display=False) as counter:
            out = inside(*args)
        counted.append(counter.get_total_flops())
        return out

    monkeypatch.setattr(frozen_linear, "backward", counting)
    torch.manual_seed(0)
    M, N, K, r = 5, 24, 40, 4
    w = torch.randn(N, K)
    lin = FrozenLoRALinear.from_weight(w, rank=r, alpha=8.0)
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == ["lora_a", "lora_b"]
    x = torch.randn(M, K, requires_grad=True)
    y = lin(x)
    q, s = quantize_int8(w)
    torch.testing.assert_close(y, x @ (q.float() * s[:, None]).t(), rtol=1e-5, atol=1e-5)  # B = 0 at init

    def backward_flops(out):
        with FlopCounterMode(display=False) as counter:
            out.square().sum().backward()
        return counter.get_total_flops() + sum(counted)

    lowrank = 2 * M * r * (N + K) * 2                  # dY·B, dYB·A, dYBᵀ·x, dYᵀ·S
    assert backward_flops(y) == 2 * M * N * K + lowrank and len(counted) == 1
    counted.clear()
    assert x.grad is not None and lin.lora_b.grad.abs().sum() > 0
    dense = torch.nn.Linear(K, N, bias=False)
    assert backward_flops(dense(x)) == 2 * (2 * M * N * K)   # dX and dW: the control can tell them apart


@pytest.mark.parametrize("steps, rounding, lo, hi", [
    (0.2, "nearest", -0.05, 0.05),      # every element under half a step: lost
    (0.2, "stochastic", 0.9, 1.1),      # kept in expectation
    (20.0, "nearest", 0.99, 1.01),
    (20.0, "stochastic", 0.99, 1.01),
])
def test_merge_reports_the_share_of_a_known_update_it_keeps(steps, rounding, lo, hi):
    torch.manual_seed(0)
    w = torch.randn(256, 256)
    lin = FrozenLoRALinear.from_weight(w, rank=1, alpha=1.0)
    before = lin.stored_weight()
    sign = torch.randint(0, 2, (256,)).float() * 2 - 1
    with torch.no_grad():   # B·A = +-steps quantisation steps of each row, in a random sign pattern
        lin.lora_b.copy_((steps * lin.weight_scale)[:, None])
        lin.lora_a.copy_(sign[None, :])
    update = lin.adapter_update()
    kept, error = merge_quality(lin.merge(rounding, torch.Generator().manual_seed(1)))
    applied = lin.stored_weight() - before
    assert lo <= kept <= hi
    assert kept == pytest.approx(((applied * update).sum() / update.square().sum()).item(),
                                 rel=1e-5, abs=1e-6)
    assert error == pytest.approx(((applied - update).norm() / update.norm()).item(), rel=1e-5)
    assert torch.all(lin.lora_b == 0)


def test_merge_keeps_output_within_int8_error():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    lin = FrozenLoRALinear.from_weight(w, rank=8, alpha=16.0)
    with torch.no_grad():
        lin.lora_b.normal_(std=0.1)
    x = torch.randn(7, 48)
    before = lin(x).detach()
    dense = dense_weight(lin)
    _, scale = quantize_int8(dense)
    lin.merge()
    after = lin(x).detach()
    assert torch.all(lin.lora_b == 0)              # restarted: the adapter adds nothing now
    # each weight moves by at most half a quantisation step, so each output by at most that times |x|_1
    bound = 0.5 * scale[None, :] * x.abs().sum(dim=1, keepdim=True) + 1e-4
    assert torch.all((after - before).abs() <= bound)
    assert not torch.equal(after, before)          # the merge really re-quantised


def test_generate_is_deterministic_for_a_seed():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.zeros((2, 1), dtype=torch.long)
    a = model.generate(idx, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    b = model.generate(idx, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    assert a.shape == (2, 11) and torch.equal(a, b)
    c = model.generate(idx, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a, c)


def test_greedy_generation_follows_the_argmax_of_the_full_forward():
    """An independent oracle: each next token is the argmax of the last position's logits of a full
    forward pass (the training path, not generate's last-position shortcut)."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 128, (2, 3))
    greedy = model.generate(idx, 6, temperature=0)
    expect = idx
    with torch.no_grad():
        for _ in range(6):
            logits = model(expect, expect)[0][:, -1]
            expect = torch.cat([expect, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, expect) and len(set(greedy[0, 3:].tolist())) > 1


def test_bad_model_configs():
    with pytest.raises(UserError, match="heads"):
        tiny_config(n_head=3)
    with pytest.raises(UserError, match="lora_rank"):
        tiny_config(frozen_layers=(0,), lora_rank=-1)
    with pytest.raises(UserError, match="lora_rank"):
        tiny_config(frozen_layers=(0,), lora_rank=33)
    with pytest.raises(UserError, match="frozen_dtype"):
        tiny_config(frozen_dtype="fp8")
    with pytest.raises(UserError, match="out of range"):
        tiny_config(frozen_layers=(5,))


def _losses_after_steps(kernels_mode, monkeypatch, steps=3):
    monkeypatch.setenv("STEP_KERNELS", kernels_mode)
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=2, frozen_layers=(0,), lora_rank=8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_training_with_triton_kernels_matches_the_reference(monkeypatch):
    """A few optimizer steps of a model with a frozen int8 layer: the Triton kernels (interpreter on
    CPU) and the PyTorch reference give the same losses."""
    if not kernels.HAS_TRITON or not (kernels.INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs triton with CUDA or TRITON_INTERPRET=1")
    if kernels.INTERPRET:
        needs_interpreter()
    ref = _losses_after_steps("reference", monkeypatch)
    tri = _losses_after_steps("triton", monkeypatch)
    assert ref[0] != ref[-1]
    torch.testing.assert_close(torch.tensor(tri), torch.tensor(ref), rtol=1e-4, atol=1e-4)


def test_bf16_frozen_store_computes_with_the_bf16_weight_and_merges_back_to_bf16():
    """The paper's variant: the frozen weight is stored in bf16 (no scale); forward and backward
    are those of the bf16 weight plus the adapter, through the same kernels API as int8."""
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    lin = FrozenLoRALinear.from_weight(w, rank=4, alpha=8.0, dtype="bf16")
    assert lin.weight_q.dtype == torch.bfloat16 and lin.weight_scale is None
    assert "weight_scale" not in lin.state_dict() and torch.equal(lin.weight_q, w.bfloat16())
    with torch.no_grad():
        lin.lora_b.normal_()
    x = torch.randn(5, 40, requires_grad=True)
    y = lin(x)
    expect = x @ w.bfloat16().float().t() + 2.0 * (x @ lin.lora_a.t()) @ lin.lora_b.t()
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 24) @ (w.bfloat16().float() + lin.adapter_update()),
                               rtol=1e-5, atol=1e-5)
    dense = dense_weight(lin)
    kept, _ = merge_quality(lin.merge())
    assert torch.equal(lin.weight_q, dense.bfloat16()) and kept > 0.99 and torch.all(lin.lora_b == 0)


def test_bf16_stochastic_rounding_is_unbiased():
    from model import round_bf16
    w = 1 + torch.rand(4096) * 2 ** -8                  # between two bf16 neighbours of 1.0
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([round_bf16(w, True, g).float() for _ in range(400)]).mean(0)
    assert (mean - w).abs().mean() < 2e-4 < (round_bf16(w).float() - w).abs().mean()


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_no_adapter_ablation_has_no_trainable_tensors_in_frozen_layers(dtype):
    torch.manual_seed(0)
    model = GPT(tiny_config(frozen_layers=(0,), lora_rank=0, frozen_dtype=dtype))
    frozen = model.layers[0]
    assert sum(p.numel() for p in frozen.parameters() if p.requires_grad) == 0
    x = torch.randn(3, 7, 32)
    w = frozen.attn.q.stored_weight()
    torch.testing.assert_close(frozen.attn.q(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    idx = torch.randint(0, 128, (2, 16))
    model(idx, idx)[1].backward()                      # trains the rest; nothing of layer 0 gets a gradient
    assert all(p.grad is None or p.numel() == 0 for p in frozen.parameters())
    assert GPT.from_checkpoint({"model": model.state_dict(),
                                "model_args": model.config.__dict__}).layers[0].attn.q.rank == 0


@pytest.mark.parametrize("kw", [dict(checkpointing=True), dict(loss_chunk=7),
                                dict(checkpointing=True, loss_chunk=16)])
def test_checkpointing_and_chunked_loss_compute_the_same_loss_and_gradients(kw):
    """Against the plain forward in float64, on a grown model (frozen int8 layers + adapters, B
    nonzero), ragged chunks and ignored targets."""
    from grow import next_stage
    torch.manual_seed(0)
    out = []
    for extra in ({}, kw):
        torch.manual_seed(0)
        model = GPT(tiny_config(n_layer=2))
        next_stage(model, 1)
        for p in model.parameters():
            if p.requires_grad:
                p.data.normal_(0, 0.05)
        model = model.double()
        idx = torch.randint(0, 128, (3, 15), generator=torch.Generator().manual_seed(1))
        targets = idx.roll(-1, 1)
        targets[0, :4] = -1
        loss = model(idx, targets, **extra)[1]
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (l0, g0), (l1, g1) = out
    assert torch.allclose(l0, l1, rtol=1e-12, atol=0) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-9, atol=1e-15), n


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_the_chunked_loss_against_cross_entropy_in_float64(chunk):
    """stepgpt/losses.py on a ragged shape with ignored targets: the loss and both gradients (scaled
    by the incoming one) against F.cross_entropy in float64; with the head frozen (no dW); under
    no_grad (the loss alone); and under bf16 autocast (fp32 out, within bf16's error)."""
    from stepgpt.losses import linear_cross_entropy
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(37, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (37,), generator=g)
    t[::4] = -1
    ref = torch.nn.functional.cross_entropy(x @ w.t(), t, ignore_index=-1)
    gx, gw = torch.autograd.grad(3 * ref, (x, w))
    loss = linear_cross_entropy(x, w, t, chunk)
    (3 * loss).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(w.grad, gw, rtol=1e-10, atol=1e-15)
    x.grad = None
    w.requires_grad_(False)
    linear_cross_entropy(x, w, t, chunk).backward()
    torch.testing.assert_close(x.grad, gx / 3, rtol=1e-10, atol=1e-15)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, t, chunk), ref, rtol=1e-12, atol=0)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        loss = linear_cross_entropy(x32, w32, t, chunk)
    loss.backward()
    assert loss.dtype == x32.grad.dtype == w32.grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=0)
    torch.testing.assert_close(x32.grad.double(), gx / 3, rtol=0, atol=2e-2 * gx.abs().max().item())
    torch.testing.assert_close(w32.grad.double(), gw / 3, rtol=0, atol=2e-2 * gw.abs().max().item())


@pytest.mark.parametrize("mode", ["reference", "triton"])
@pytest.mark.slow
def test_compiled_model_keeps_frozen_linears_in_one_graph_and_matches_eager(mode, monkeypatch):
    """torch.compile (inductor, CPU) traces the whole STEP model in one graph: the seven frozen
    linears of layer 0 are custom ops inside it, not graph breaks. "triton": the Triton kernels
    (the interpreter) with CUDA's dispatch, the path choice traced through its table of measured
    choices (one entry measured here, by a stand-in timer, before compiling)."""
    if mode == "triton":
        if not (kernels.HAS_TRITON and kernels.INTERPRET):
            pytest.skip("needs the Triton interpreter")
        needs_interpreter()
        monkeypatch.setenv("STEP_KERNELS", "triton")
        monkeypatch.setattr(kernels, "_on_gpu", lambda x: True)    # CUDA's decisions, in the interpreter
        monkeypatch.setattr(kernels, "CHOICES", {})
        fixed = {"fused": 1, "hybrid": 2, "reference": 3}
        monkeypatch.setattr(kernels, "_cuda_time", lambda path, fn: fixed[path])
        monkeypatch.setattr(frozen_lora, "DECODE_M", 8)   # the test's 32 tokens: a tuned size
        tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    torch.manual_seed(0)
    cfg = tiny_config(frozen_layers=(0,), lora_rank=4)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    if mode == "triton":   # an eager training call measures the paths of the layer's shapes
        model(idx, idx)[1].backward()
        model.zero_grad()
        assert len(kernels.CHOICES) == 3     # (C -> C), (C -> F), (F -> C) at 32 tokens
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert explained.graphs[0].code.count("torch.ops.step.frozen_lora_linear.default") == 7
    torch._dynamo.reset()
    logits, loss = torch.compile(model)(idx, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    eager_logits, eager_loss = model(idx, idx)
    eager_loss.backward()
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert any("lora_a" in n for n in grads)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    if mode == "triton":
        torch.backends.cuda.matmul.allow_tf32 = tf32


# ---------------------------------------------------------------------------------------------
# int8 quantisation (model.quantize_int8)

def _weight(n, k, dtype=torch.float32):
    w = torch.randn(n, k) * torch.rand(n, 1) * 3
    w[1] = 0                                                       # all-zero row -> scale 1
    w[2, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])          # scale 1: exact halves
    return w.to(dtype)


def _check_roundtrip(w, q, scale):
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == w.shape and scale.shape == (w.shape[0],)
    assert q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w.float()).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert scale[1] == 1 and (q[1] == 0).all()
    # torch.round sends halves to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2
    assert q[2, :5].tolist() == [127, 0, 2, 2, -2]


def test_quantize_reference_roundtrip():
    w = _weight(37, 301)
    _check_roundtrip(w, *quantize_int8(w))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_refuses_nan_and_inf(bad):
    w = _weight(37, 600)
    w[20, 555] = bad
    with pytest.raises(ValueError,
                       match=r"1 row\(s\) of the 37x600 weight hold NaN or inf \(first: row 20\)"):
        quantize_int8(w)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    w = _weight(64, 512)
    g = torch.Generator().manual_seed(0)
    q_near, scale = quantize_int8(w)
    x = w / scale[:, None]
    draws = torch.stack([quantize_int8(w, stochastic=True, generator=g)[0].float() for _ in range(200)])
    assert ((draws - x).abs() < 1).all() and draws.abs().max() <= 127
    # the mean of 200 draws sits near x; round-to-nearest is off by up to half a step (the control)
    assert (draws.mean(0) - x).abs().mean() < 0.05 < (q_near.float() - x).abs().mean()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(quantize_int8(w, True, g1)[0], quantize_int8(w, True, g2)[0])
