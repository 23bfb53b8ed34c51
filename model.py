"""A LLaMA-style decoder in one file, with frozen (int8 or bf16) + LoRA layers for STEP.

References: nanoGPT's model.py (structure), LLaMA (RMSNorm pre-norm, RoPE, SwiGLU, no biases),
LoRA (Hu et al. 2022) and ReLoRA (merge-and-reinit) for the adapters, STEP (Yano et al., NAACL
2025) for which layers are frozen. A layer is either fully trainable (seven nn.Linear) or frozen:
its seven linears are FrozenLoRALinear (int8 weight + row scale, frozen; LoRA A/B trainable)
and its norms stop learning. `GPTConfig.frozen_layers` says which, so a checkpoint's config alone
rebuilds the exact module tree.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from frozen_linear import frozen_lora_linear
from stepgpt.errors import UserError
from stepgpt.losses import linear_cross_entropy


@dataclass
class GPTConfig:
    """The model's keys. A run's config (stepgpt/config.py) is these plus the run's own, so each
    model key is declared and checked here alone."""
    block_size: int = 256
    vocab_size: int = 0             # rows of the embedding and head: the data's vocabulary padded up
                                    # to a multiple of 64 (faster matmuls); a run's 0 takes the data's
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    ffn_hidden: int = 0             # 0: about 8/3 * n_embd rounded up to 64 (LLaMA's SwiGLU sizing)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    lora_rank: int = 16             # adapters on frozen layers: rank r (0: none) and alpha (scale alpha/r)
    lora_alpha: float = 32.0
    frozen_dtype: str = "int8"      # frozen linears: int8 + row scale (ours) or bf16 (the paper's)
    frozen_layers: tuple = ()       # indices of the frozen (+ LoRA) layers; a run's stages set them
    train_embeddings: bool = True   # False: embeddings, final norm and head are frozen too

    def __post_init__(self):
        self.frozen_layers = tuple(sorted(int(i) for i in self.frozen_layers))
        for key in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise UserError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("vocab_size", "ffn_hidden"):
            if getattr(self, key) < 0:
                raise UserError(f"{key}={getattr(self, key)} must be >= 0 (0: {key} is chosen for you)")
        for key in ("rope_theta", "norm_eps", "lora_alpha"):
            if not 0 < getattr(self, key) < math.inf:
                raise UserError(f"{key}={getattr(self, key)} must be a finite number > 0")
        if self.ffn_hidden == 0:
            self.ffn_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64)
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise UserError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even "
                            f"size (RoPE rotates pairs); pick n_embd divisible by 2*n_head")
        if self.frozen_layers and not 0 <= self.frozen_layers[0] <= self.frozen_layers[-1] < self.n_layer:
            raise UserError(f"frozen_layers {self.frozen_layers} out of range for n_layer={self.n_layer}")
        if not 0 <= self.lora_rank <= self.n_embd:
            raise UserError(f"lora_rank={self.lora_rank} must be between 0 (no adapters) and "
                            f"n_embd={self.n_embd}")
        if self.frozen_dtype not in FROZEN_DTYPES:
            raise UserError(f"frozen_dtype={self.frozen_dtype!r}: use one of {', '.join(FROZEN_DTYPES)}")

    @classmethod
    def from_dict(cls, d, **overrides):
        """The fields of d (a checkpoint's model_args, or a run config's dict) that name a field here."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in {**d, **overrides}.items() if k in known})


FROZEN_DTYPES = ("int8", "bf16")


# ----------------------------------------------------------------------------------------------
# building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 under autocast: the mean of squares loses too much in bf16
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class FrozenLoRALinear(nn.Module):
    """y = x W^T + (alpha/r) (x A^T) B^T with W frozen and A, B trainable. W is stored in int8 with
    one fp32 scale per output row (W = q * scale; ours) or in bf16 (the paper's; no scale)."""

    def __init__(self, in_features, out_features, rank, alpha, generator=None, dtype="int8"):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.lora_scale = alpha / rank if rank else 0.0   # rank 0: the paper's no-adapter ablation
        # the store is frozen parameters (requires_grad=False), not buffers: FSDP shards parameters only
        int8 = dtype == "int8"
        store = torch.zeros(out_features, in_features, dtype=torch.int8 if int8 else torch.bfloat16)
        self.weight_q = nn.Parameter(store, requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features), requires_grad=False) if int8 else None
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.reset_adapter(generator)

    @classmethod
    def from_weight(cls, w, rank, alpha, generator=None, dtype="int8"):
        m = cls(w.shape[1], w.shape[0], rank, alpha, generator, dtype).to(w.device)
        m.store(w.detach())
        return m

    def store(self, w, stochastic=False, generator=None):
        if self.weight_scale is None:
            self.weight_q.data = round_bf16(w, stochastic, generator)
        else:
            self.weight_q.data, self.weight_scale.data = quantize_int8(w, stochastic, generator)

    def stored_weight(self):
        """The frozen weight as a float tensor (without the adapter)."""
        scale = 1.0 if self.weight_scale is None else self.weight_scale[:, None]
        return self.weight_q.float() * scale

    @torch.no_grad()
    def reset_adapter(self, generator=None):
        # LoRA's init: A as nn.Linear's weight (Kaiming-uniform, a=sqrt(5): U(+-1/sqrt(in))), B zero,
        # so the adapter adds nothing. A is drawn on the CPU, so one seeded generator gives the same
        # A on every device and every rank.
        bound = 1 / math.sqrt(self.in_features)
        self.lora_a.copy_(torch.empty(self.lora_a.shape).uniform_(-bound, bound, generator=generator))
        self.lora_b.zero_()

    def adapter_update(self):
        return self.lora_scale * (self.lora_b.detach().float() @ self.lora_a.detach().float())   # (out, in)

    @torch.no_grad()
    def merge(self, rounding="nearest", generator=None):
        """Fold the adapter into the frozen weight (W + s B A, rounded back to its store) and restart
        it. Round-to-nearest loses every element of the update smaller than half a rounding step
        (and adds rounding noise); stochastic rounding keeps the update in expectation.
        -> the sums over the weight of <applied, update>, |update|^2, |applied - update|^2."""
        before = self.stored_weight()
        update = self.adapter_update()
        self.store(before + update, stochastic=rounding == "stochastic", generator=generator)
        applied = self.stored_weight() - before
        self.reset_adapter(generator)
        return torch.stack([(applied * update).sum(), update.square().sum(),
                            (applied - update).square().sum()]).double().cpu()

    def forward(self, x):
        return frozen_lora_linear(x, self.weight_q, self.weight_scale, self.lora_a, self.lora_b,
                                  self.lora_scale)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, {self.weight_q.dtype}, rank={self.rank}"


def quantize_int8(w, stochastic=False, generator=None):
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N]) with w ~= q * scale: symmetric, one scale
    per output row (absmax / 127), to nearest or stochastically (floor(x + u), u ~ U[0, 1): E[q] = x,
    so updates smaller than a step survive on average; the noise is drawn on the CPU from
    `generator`, the same on every device)."""
    w = w.float()
    absmax = w.abs().amax(dim=1)                       # NaN propagates, inf stays inf
    bad = (~torch.isfinite(absmax)).nonzero().flatten().tolist()   # rounding would destroy such a row
    if bad:
        raise ValueError(f"quantize_int8: {len(bad)} row(s) of the {w.shape[0]}x{w.shape[1]} weight hold "
                         f"NaN or inf (first: row {bad[0]}); the weights diverged or were loaded damaged")
    # an all-zero row gets scale 1 so that dequantising it still gives exact zeros, never NaN
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    x = w / scale[:, None]
    if stochastic:
        x = torch.floor(x + torch.rand(x.shape, generator=generator).to(x.device))
    return torch.round(x).clamp_(-127, 127).to(torch.int8), scale


def round_bf16(w, stochastic=False, generator=None):
    """fp32 -> bf16, to nearest (torch's cast) or stochastically: add uniform noise below the 16
    bits bf16 drops, then truncate them (unbiased; noise drawn on the CPU from `generator`)."""
    w = w.float()
    if not stochastic:
        return w.to(torch.bfloat16)
    noise = torch.randint(0, 1 << 16, w.shape, generator=generator, dtype=torch.int32).to(w.device)
    bits = (w.contiguous().view(torch.int32) + noise) & -65536          # -65536 = 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)                  # exact: the low bits are zero


def merge_quality(sums):
    """-> (kept, error) of a merge's sums (FrozenLoRALinear.merge): the share of the update that the
    merged weights carry, their projection on it (1: all of it; round-to-nearest loses every element
    under half a rounding step), and the rounding noise |applied - update| / |update|."""
    return (sums[0] / sums[1]).item(), (sums[2] / sums[1]).sqrt().item()


def dense_weight(linear):
    """The float weight a trainable nn.Linear (or RMSNorm) or a FrozenLoRALinear computes with; for the
    latter W + (alpha/r) B A, the adapter included (growth copies it, the export writes it)."""
    if isinstance(linear, FrozenLoRALinear):
        return linear.stored_weight() + linear.adapter_update()
    return linear.weight.detach().float()


def rope_cache(head_dim, block_size, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)   # (hs/2,)
    angles = torch.outer(torch.arange(block_size).float(), inv_freq)             # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head (the GPT-NeoX / HF LLaMA convention)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        d = cfg.n_embd
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        hs = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hs).transpose(1, 2)   # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_head, hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, hs).transpose(1, 2)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        # PyTorch's CPU attention runs bf16 up to 2.3x slower than fp32 (bench/RESULTS.md): fp32 on a CPU
        with torch.autocast("cpu", enabled=False):
            dt = torch.float32 if x.device.type == "cpu" and q.dtype == torch.bfloat16 else q.dtype
            y = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), is_causal=True)  # (B, nh, T, hs)
        return self.o(y.to(q.dtype).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))   # SwiGLU


LINEARS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
RESIDUAL_OUT = ("attn.o", "mlp.down")   # projections that write into the residual stream


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def linear(self, name):
        parent, child = name.split(".")
        return getattr(getattr(self, parent), child)

    @property
    def frozen(self):
        return isinstance(self.attn.q, FrozenLoRALinear)

    def freeze(self, rank, alpha, generator=None, dtype="int8"):
        """Store the seven linears frozen (int8 or bf16) behind fresh LoRA adapters; stop training
        the norms."""
        for name in LINEARS:
            parent, child = name.split(".")
            frozen = FrozenLoRALinear.from_weight(dense_weight(self.linear(name)), rank, alpha, generator,
                                                  dtype)
            setattr(getattr(self, parent), child, frozen)
        self.attn_norm.weight.requires_grad_(False)
        self.mlp_norm.weight.requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# the model

class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = rope_cache(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_merge = None     # the sums of the latest merge_adapters(), for the log (merge_quality)
        self.apply(self._init_weights)
        for block in self.layers:
            for name in RESIDUAL_OUT:  # GPT-2's scaled init keeps the residual stream's variance flat
                nn.init.normal_(block.linear(name).weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
        for i in cfg.frozen_layers:
            self.layers[i].freeze(cfg.lora_rank, cfg.lora_alpha, dtype=cfg.frozen_dtype)
        if not cfg.train_embeddings:
            self.freeze_embeddings()

    @classmethod
    def from_checkpoint(cls, ckpt, path="checkpoint"):
        """The model a checkpoint dict (stepgpt.checkpoint.load_checkpoint) holds: its config rebuilds
        the exact module tree (which layers are int8 + LoRA), then the weights load into it."""
        model = cls(GPTConfig.from_dict(ckpt["model_args"]))
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            lines = str(e).strip().splitlines()
            why = (lines[1:] or lines)[0].strip()
            raise UserError(f"{path} does not match its own model config ({why}); it is damaged") from None
        return model

    def merge_adapters(self, rounding="nearest", generator=None):
        """Fold every frozen layer's adapters into its frozen weights and restart them; their merge
        sums, added up, stay in self.last_merge for the log."""
        sums = [sum(self.layers[i].linear(name).merge(rounding, generator) for name in LINEARS)
                for i in self.config.frozen_layers]
        self.last_merge = sum(sums) if sums else None

    def freeze_embeddings(self):
        self.config.train_embeddings = False
        for p in (self.wte.weight, self.norm.weight, self.lm_head.weight):
            p.requires_grad_(False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, checkpointing=False, loss_chunk=0):
        """idx (B, T) -> (logits, loss). Without targets: the last position's logits (B, 1, V) and
        None. With targets: the logits (B, T, V) and the mean loss; with loss_chunk > 0 the loss only
        (logits None), computed loss_chunk tokens at a time so the full logits never exist.
        checkpointing keeps each block's input only and recomputes the block in the backward. Both
        are a run's settings for saving memory in training (train.py passes them), not the model's."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        x = self.wte(idx)                                           # (B, T, C)
        for block in self.layers:
            if checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None               # inference: last position only
        if loss_chunk:
            return None, linear_cross_entropy(x, self.lm_head.weight, targets, loss_chunk)
        logits = self.lm_head(x)                                    # (B, T, V)
        up = torch.promote_types(logits.dtype, torch.float32)       # the loss in fp32 at least
        loss = F.cross_entropy(logits.to(up).view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # -- accounting ----------------------------------------------------------------------------

    def num_params(self):
        """(trainable, frozen) element counts; frozen counts int8 weights and frozen norms, not row scales."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for n, p in self.named_parameters()
                     if not p.requires_grad and not n.endswith("weight_scale"))
        return trainable, frozen

    def estimate_flops(self):
        """Training FLOPs per token: 6 per trainable matmul weight (forward, dX, dW), 4 per frozen
        one (no dW), plus attention scores and mixing (PaLM's 12*L*d*T, causal mask not credited)."""
        cfg = self.config
        flops = 6 * cfg.n_embd * cfg.vocab_size                     # lm_head (embedding lookup: free)
        for block in self.layers:
            for name in LINEARS:
                lin = block.linear(name)
                if isinstance(lin, FrozenLoRALinear):
                    flops += 4 * lin.weight_q.numel() + 6 * (lin.lora_a.numel() + lin.lora_b.numel())
                else:
                    flops += 6 * lin.weight.numel()
        return flops + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    # -- sampling ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=0, generator=None):
        """Extend idx (B, T) by max_new_tokens tokens; temperature 0 means greedy."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
