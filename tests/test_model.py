import math

import pytest
import torch

from kernels import dequantize_int8, quantize_int8
from model import GPT, FrozenLoRALinear, UserError
from tests.helpers import tiny_config


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


def test_frozen_lora_linear_has_no_weight_gradient_and_adapter_starts_at_zero():
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    lin = FrozenLoRALinear.from_weight(w, rank=4, alpha=8.0)
    assert [n for n, _ in lin.named_parameters()] == ["lora_a", "lora_b"]
    x = torch.randn(5, 40, requires_grad=True)
    y = lin(x)
    q, s = quantize_int8(w)
    torch.testing.assert_close(y, x @ dequantize_int8(q, s).t(), rtol=1e-5, atol=1e-5)  # B = 0 at init
    y.square().sum().backward()
    assert lin.weight_q.grad is None and lin.weight_scale.grad is None
    assert x.grad is not None and lin.lora_b.grad.abs().sum() > 0


def test_merge_keeps_output_within_int8_error():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    lin = FrozenLoRALinear.from_weight(w, rank=8, alpha=16.0)
    with torch.no_grad():
        lin.lora_b.normal_(std=0.1)
    x = torch.randn(7, 48)
    before = lin(x).detach()
    dense = lin.dense_weight()
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
    greedy = model.generate(idx, 5, temperature=0)
    assert torch.equal(greedy, model.generate(idx, 5, temperature=0))


def test_bad_model_configs():
    with pytest.raises(UserError, match="heads"):
        tiny_config(n_head=3)
    with pytest.raises(UserError, match="lora_rank"):
        tiny_config(frozen_layers=(0,), lora_rank=0)
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
    import kernels
    if not kernels.HAS_TRITON or not (kernels.INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs triton with CUDA or TRITON_INTERPRET=1")
    ref = _losses_after_steps("reference", monkeypatch)
    tri = _losses_after_steps("triton", monkeypatch)
    assert ref[0] != ref[-1]
    torch.testing.assert_close(torch.tensor(tri), torch.tensor(ref), rtol=1e-4, atol=1e-4)
