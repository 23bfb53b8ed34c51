"""The memory model beyond the paper's Eq. 1-3 (grow.py): Muon's and 8-bit AdamW's state, ZeRO-1, the
activations autograd saves, the peak of a whole training step, the cheapest plan under a budget.
plan.py prints them for a config.

Counts are in our fp32 accounting unless an `accounting` says "bf16" (the paper's). bench/peak_memory.py
measures what these functions predict (the allocator on CPU, max_memory_allocated on CUDA).
"""
import math

import grow
from stepgpt.errors import UserError


def trainable_bytes(accounting, zero_world=1):
    """Bytes per trainable parameter: weight and gradient, plus the optimizer's share, which ZeRO-1
    divides over zero_world ranks (ours: fp32 AdamW moments, 8 B; the paper's mixed precision: bf16
    weight and gradient, fp32 master weight and moments, 12 B)."""
    sharded = 8 if accounting == "int8" else 12
    return grow.TRAINABLE_BYTES - sharded + sharded / zero_world


# bitsandbytes' AdamW8bit defaults (min_8bit_size, blocksize)
ADAMW8BIT_MIN_SIZE, ADAMW8BIT_BLOCK = 4096, 256
ADAMW8BIT_CODEBOOKS = 2 * 256 * 4                   # its two fp32 quantisation maps, one pair per optimizer


def adamw8bit_state_bytes(numel):
    """bitsandbytes' AdamW8bit state of one tensor: two uint8 moments and one fp32 absmax per block
    of 256 entries for each; tensors under 4,096 entries keep fp32 moments (8 B each). The two code
    books (ADAMW8BIT_CODEBOOKS) are shared by all tensors."""
    if numel < ADAMW8BIT_MIN_SIZE:
        return 8 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / ADAMW8BIT_BLOCK)


def muon_shapes(cfg, n_trainable, n_frozen, adapters=False):
    """The (rows, cols) of the matrices optimizer=muon gives torch.optim.Muon (stepgpt/optim.py's
    hidden_matrices): the trainable layers' seven linear weights, and with adapters (muon_adapters)
    the frozen layers' LoRA A (r, in) and B (out, r); the rest (embeddings, head, norms) takes AdamW."""
    shapes = grow.layer_shapes(cfg)
    adapter = [(cfg.lora_rank, k) for _, k in shapes] + [(n, cfg.lora_rank) for n, _ in shapes]
    return shapes * n_trainable + (adapter * n_frozen if adapters and cfg.lora_rank else [])


def muon_step_bytes(shapes):
    """torch.optim.Muon's temporaries, one matrix at a time: the Nesterov update in fp32 (4 B an
    entry), its bf16 copy and the next Newton-Schulz iterate (2 + 2 B), the Gram matrix and its
    polynomial (2 x 2 B an entry of the smaller side squared); the largest matrix sets the peak (the
    profiler's record of a step: 8 rows x cols + 4 min(rows, cols)^2 B exactly, at 512 x 192)."""
    return max((8 * a * b + 4 * min(a, b) ** 2 for a, b in shapes), default=0)


def state_bytes(cfg, n_trainable=None, n_frozen=None, accounting="int8", train_embeddings=True,
                layers_only=False, zero_world=1, optimizer="adamw"):
    """grow.state_bytes with the optimizer's state as it is run: with zero_world > 1 per rank under
    ZeRO-1 (about: ZeRO shards whole tensors, so the ranks' shares differ a little);
    optimizer="adamw8bit" (our int8 accounting only): fp32 weight and gradient, 8-bit moments;
    optimizer="muon" ("muon+lora": muon_adapters=True): Muon's one fp32 momentum buffer (4 B) instead
    of AdamW's two moments (8 B) on the muon_shapes, in either accounting (12 B per such parameter in
    all, as Eq. 1-2 count it: 2 + 2 + 4 master + 4 momentum in the paper's mixed precision)."""
    if n_frozen is None:
        n_frozen = len(cfg.frozen_layers)
        n_trainable = cfg.n_layer - n_frozen
    args = (cfg, n_trainable, n_frozen, accounting, train_embeddings, layers_only)
    if optimizer in ("adamw", "muon", "muon+lora"):
        muon = [a * b for a, b in muon_shapes(cfg, n_trainable, n_frozen, optimizer == "muon+lora")]
        adamw = grow.state_bytes(*args, per_trainable=trainable_bytes(accounting, zero_world))
        return int(adamw - 4 * sum(muon) * (optimizer != "adamw") / zero_world)
    if accounting != "int8" or zero_world != 1:
        raise ValueError("adamw8bit is counted in the int8 accounting, without ZeRO-1 (train.py refuses "
                         "both)")
    sizes = grow.trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings, layers_only)
    books = ADAMW8BIT_CODEBOOKS * (max(sizes) >= ADAMW8BIT_MIN_SIZE)
    moments = sum(8 * n + adamw8bit_state_bytes(n) for n in sizes)   # fp32 weight and gradient, 8-bit moments
    return grow.state_bytes(*args, per_trainable=0) + moments + books


def activation_bytes(cfg, tokens, n_trainable, n_frozen=0, checkpointing=False, loss_chunk=0,
                     dtype="float32"):
    """What autograd holds for the backward of a micro-batch of `tokens` tokens through n_trainable
    trainable and n_frozen frozen layers, at the start of the backward (the step's peak when
    activations dominate). dtype "float32" (CPU, or dtype=float32), per token, in elements:
      a layer: 11C + 4F: each RMSNorm its input, input * rstd and output (3C, twice); q and k after
        RoPE, v, the SDPA output and its (T, C) copy for the o projection (5C); SwiGLU's gate,
        silu(gate), up and their product (4F); a frozen layer adds x A^T of its seven linears (7r);
      the head: the final norm (3C), the log-softmax the loss saves and, in the backward, its
        gradient and the logits' (3V; train.py keeps no name for the logits themselves).
    Activation checkpointing keeps a layer's input (C) and recomputes one layer at a time in the
    backward, whose peak, the recomputed activations with the gradients of them, is 10.5C + 7.5F
    (fitted to the allocator at C in {192, 384}, F in {512, 1024}, within 2 %: 13C + 4F, the
    activations and two gradients, fell 10-18 % short where the chunked loss stopped hiding it).
    loss_chunk (stepgpt/losses.py) holds instead dX and its scaled copy (2C) for every token, the log-
    softmax of one chunk with its input (2V) for loss_chunk tokens, and dW with its scaled copy (2VC).
    tests/test_grow.py checks this against the allocator within 10 %.
    dtype "bfloat16" (bf16 autocast on CUDA), per token, in bytes: the residual stream stays fp32
    (each norm's input, 4C twice); every linear saves its own bf16 copy of its input (q, k, v: 6C;
    gate, up: 4C); q and k before RoPE and after, and v (10C); the SDPA output and its copy for o
    (4C); SwiGLU's four bf16 tensors (8F); a frozen layer's x A^T (7 x 2r). The head: the final
    norm and the lm_head's input copy (6C), the fp32 log-softmax, its gradient and the logits'
    gradient in fp32 and bf16 (14V); with loss_chunk dX twice (8C), one chunk's fp32 logits and log-
    softmax (8V) and dW twice in fp32 (8VC). Checkpointing keeps each layer's fp32 input (4C) and, at the
    recomputed layer, its activations and their gradients (44C + 16F). Derived from what each op
    saves, not fitted: bench/peak_memory.py --device cuda measures it (bench/RESULTS.md)."""
    C, F, V, r = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size, cfg.lora_rank
    layers, share = n_trainable + n_frozen, min(loss_chunk, tokens) / tokens if loss_chunk else 1
    if dtype == "float32":
        layer, frozen, head, kept = 4 * (11 * C + 4 * F), 4 * 7 * r, 4 * 3 * C, 4 * C
        redo = 4 * (10.5 * C + 7.5 * F)
        loss = 4 * (2 * C + 2 * V * share if loss_chunk else 3 * V)
    else:
        layer, frozen, head, kept, redo = 32 * C + 8 * F, 2 * 7 * r, 6 * C, 4 * C, 44 * C + 16 * F
        loss = 8 * C + 8 * V * share if loss_chunk else 14 * V
    head_grads = 8 * V * C if loss_chunk else 0   # dW and its scaled copy, in fp32, whatever the tokens
    if checkpointing:
        return int(tokens * layers * kept + max(tokens * (head + loss) + head_grads,
                                                tokens * (redo + frozen * (n_frozen > 0))))
    return int(tokens * (layers * layer + n_frozen * frozen + head + loss) + head_grads)


def sharded_state(cfg, n_trainable, n_frozen, world, mode, train_embeddings=True, optimizer="adamw"):
    """-> (weights, gradients, optimizer state) bytes per rank, in our int8 accounting with fp32 AdamW
    (4 + 4 + 8 B per trainable parameter; the frozen store as stored, no gradient, no state) on
    `world` ranks: mode "ddp" (every rank holds all of it), "zero1" (the optimizer state divided over
    the ranks) or "fsdp" (all three divided: FSDP2 shards every tensor by rows, the int8 store too;
    a shard is within a row of 1/world). optimizer "muon" ("muon+lora"): 4 B of state on Muon's
    matrices (DDP and ZeRO-1: train.py refuses Muon under FSDP)."""
    trainable = sum(grow.trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings))
    weights = grow.state_bytes(cfg, n_trainable, n_frozen, train_embeddings=train_embeddings, per_trainable=4)
    muon = sum(a * b for a, b in muon_shapes(cfg, n_trainable, n_frozen, optimizer == "muon+lora"))
    state = 8 * trainable - 4 * muon * (optimizer != "adamw")
    parts = {"ddp": (1, 1, 1), "zero1": (1, 1, world), "fsdp": (world, world, world)}[mode]
    return tuple(b / n for b, n in zip((weights, 4 * trainable, state), parts))


def fsdp_gathered_bytes(cfg, n_trainable, n_frozen, dtype="float32"):
    """What FSDP2 holds whole on a rank besides its shards, at the start of the backward: the root
    (embeddings, final norm, head, fp32: gathered for the forward and kept through the backward),
    the block being computed and the next one, prefetched (a trainable block in bf16 under bf16
    autocast, its MixedPrecisionPolicy; a frozen block as stored), and one block's whole fp32
    gradient before its reduce-scatter."""
    weights, rows, norms, adapters = grow.layer_counts(cfg)
    store = 2 * weights if cfg.frozen_dtype == "bf16" else weights + 4 * rows
    blocks = [(2 if dtype == "bfloat16" else 4) * (weights + norms)] * bool(n_trainable)
    blocks += [store + 4 * (norms + adapters)] * bool(n_frozen)
    grad = 4 * (weights + norms if n_trainable else adapters)
    return 4 * grow.outside_params(cfg) + 2 * max(blocks) + grad


def step_peak_bytes(cfg, n_trainable, n_frozen, tokens, train_embeddings=True, checkpointing=False,
                    loss_chunk=0, optimizer="adamw", zero_world=1, dtype="float32", fsdp_world=1):
    """The peak of one training step, the larger of: the model state without the gradients (set to
    None after every step; they appear as the backward runs and its saved tensors go) plus the
    activations at the start of the backward; the full state at the optimizer step plus the
    optimizer's temporaries. foreach AdamW's: the square root of the second moments, at most the
    trainable parameters' size (measured 3/4 of it at step_small, so this side over-predicts).
    bitsandbytes' AdamW8bit on CPU works one tensor at a time in fp32: both moments dequantised, the
    gradient, the square root and the denominator, 5 copies of the largest tensor (its CUDA kernel
    updates in place, so there this side over-predicts). optimizer="muon": the larger of Muon's
    (muon_step_bytes) and AdamW's on the rest. With zero_world > 1: per rank under ZeRO-1
    (each rank steps its share; the gradients are whole on every rank). dtype "bfloat16" (bf16
    autocast): bf16 activations (activation_bytes), and autocast's bf16 copies of the trainable
    linears' weights and of the head's, which the backward holds (2 B each). With fsdp_world > 1: per
    rank under FSDP (AdamW): the sharded state (sharded_state) plus what FSDP gathers
    (fsdp_gathered_bytes); under bf16 autocast only the head, which FSDP gathers in fp32, gets a
    bf16 copy."""
    act = activation_bytes(cfg, tokens, n_trainable, n_frozen, checkpointing, loss_chunk, dtype)
    if fsdp_world > 1:
        weights, grads, adam = sharded_state(cfg, n_trainable, n_frozen, fsdp_world, "fsdp", train_embeddings)
        act += fsdp_gathered_bytes(cfg, n_trainable, n_frozen, dtype)
        act += 2 * cfg.vocab_size * cfg.n_embd if dtype == "bfloat16" else 0
        state = weights + grads + adam
        return int(max(state - grads + act, state + grads))   # AdamW's foreach temporaries: its shard's
    state = state_bytes(cfg, n_trainable, n_frozen, train_embeddings=train_embeddings, optimizer=optimizer,
                        zero_world=zero_world)
    sizes = grow.trainable_tensors(cfg, n_trainable, n_frozen, train_embeddings)
    grads = 4 * sum(sizes)
    if dtype == "bfloat16":
        act += 2 * (n_trainable * grow.layer_counts(cfg)[0] + cfg.vocab_size * cfg.n_embd)
    temp = 5 * 4 * max(sizes) if optimizer == "adamw8bit" else grads / zero_world
    if optimizer in ("muon", "muon+lora"):   # Muon's matrices one at a time, then AdamW's on the rest
        shapes = muon_shapes(cfg, n_trainable, n_frozen, optimizer == "muon+lora")
        temp = max(muon_step_bytes(shapes), (grads - 4 * sum(a * b for a, b in shapes)) / zero_world)
    return int(max(state - grads + act, state + temp))


def configured_peaks(tcfg, cfg, stage_layers, dtype, world=1):
    """The step peak of each stage of the run config tcfg as it is configured (micro-batch,
    checkpointing, chunked loss, optimizer, and on `world` ranks its fsdp or zero1) for the final
    model cfg, in `dtype` ("bfloat16": bf16 autocast, how a CUDA run trains); per rank under FSDP
    and ZeRO-1, as plan.py's per-GPU table."""
    optimizer = planned_optimizer(tcfg)
    frozen = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    shards = dict(fsdp_world=world if tcfg.fsdp else 1, zero_world=world if tcfg.zero1 else 1)
    return [step_peak_bytes(cfg, n, f, tcfg.batch_size * tcfg.block_size, tcfg.train_embeddings or f == 0,
                            tcfg.activation_checkpointing, tcfg.loss_chunk, optimizer=optimizer, dtype=dtype,
                            **shards)
            for n, f in zip(stage_layers, frozen)]


def planned_optimizer(cfg):
    """The optimizer the planner counts for a run config: adamw8bit and muon as they are ("muon+lora"
    where Muon steps the adapters too), GaLore as the AdamW it wraps."""
    if cfg.optimizer == "muon":
        return "muon+lora" if cfg.muon_adapters else "muon"
    return "adamw8bit" if cfg.optimizer == "adamw8bit" else "adamw"


GPU_BYTES = 80e9   # the GPUs the shipped configs are for (H100/A100 80 GB), of which 10 % stay free


def settings(world=8):
    """The model-state accountings the plan compares: (name, state_bytes keywords). The paper's
    (bf16 mixed precision) and ours: int8 frozen store with fp32 AdamW, with 8-bit AdamW
    (optimizer=adamw8bit), with ZeRO-1 over `world` ranks (zero1=True; per rank), and with Muon on
    the layers' matrices (optimizer=muon)."""
    out = [("paper bf16", dict(accounting="bf16")), ("int8", dict(accounting="int8")),
           ("int8 + 8-bit AdamW", dict(accounting="int8", optimizer="adamw8bit"))]
    zero = [(f"int8 + ZeRO-1 / {world}", dict(accounting="int8", zero_world=world))]
    return out + (zero if world > 1 else []) + [("int8 + Muon", dict(accounting="int8", optimizer="muon"))]


def smallest_plan(cfg, target_layers, budget, choices, max_stages=8, **kw):
    """The cheapest plan whose model-state peak fits `budget` bytes: the fewest stages (the least
    change to training), then the first of `choices` ((name, state_bytes keywords), in the order
    we would rather run them). -> (K, name, layers, peak)."""
    best = None
    for k in range(1, min(max_stages, target_layers) + 1):
        for name, ckw in choices:
            layers = grow.plan_stages(cfg, target_layers, k, state_bytes, **ckw, **kw)
            peak = max(grow.stage_memory(cfg, layers, state_bytes, **ckw, **kw))
            if peak <= budget:
                return k, name, layers, peak
            best = min(best or peak, peak)
    raise UserError(f"no plan of up to {min(max_stages, target_layers)} stages fits {budget / 2**30:.2f} "
                    f"GiB (the best needs {best / 2**30:.2f} GiB of model state); raise the budget or lower "
                    f"lora_rank")
