"""A run's configuration: every key with its default (TrainConfig), read from config files and
--key=value overrides (load_config), each value checked once, before any work is done.

The model's keys are GPTConfig's (model.py), which TrainConfig extends: each key is declared and
checked in one place. A config file is plain Python assignments (`batch_size = 8`).
"""
import ast
import math
import os
import re
import types
from dataclasses import MISSING, dataclass, field, fields

import grow
from model import GPTConfig
from stepgpt.errors import UserError


@dataclass
class TrainConfig(GPTConfig):
    # I/O
    out_dir: str = "out"
    data_dir: str = "data/shakespeare"  # train.bin, val.bin, meta.json (data/prepare.py)
    init_from: str = "auto"             # 'auto': continue this run from out_dir's newest checkpoint, or
                                        # start it when there is none (a scheduler reruns the same
                                        # command); 'scratch' (out_dir must hold none), 'resume' (out_dir's
                                        # newest ckpt-<iter>.pt), 'resume_previous' (the one before it), a
                                        # checkpoint path (weights only) or 'hf:PATH' (stage 1 from a HF
                                        # LLaMA folder)
    eval_interval: int = 100
    eval_iters: int = 20
    eval_tokens: int = 0                # >0: val loss (and perplexity) on the val split's first eval_tokens
                                        # tokens, padding not counted, in whole batches and in a fixed order
                                        # (the yardstick's 10M); 0: eval_iters random batches
    log_interval: int = 10
    keep_checkpoints: int = 2           # the newest k checkpoints stay in out_dir (ckpt-<iter>.pt)
    eval_only: bool = False
    dry_run: bool = False               # print the resolved config, stage plan and model, then exit;
                                        # out_dir is left untouched
    stop_at: int = 0                    # >0: save and stop at this iteration, as a preempted job would
    sample_tokens: int = 200            # a sample written to out_dir/sample.txt at the end (0: none)
    seed: int = 1337
    # STEP stages (the model's keys are GPTConfig's; n_layer is the depth of a one-stage run)
    stage_layers: list = field(default_factory=list)  # layers added per stage, e.g. [4, 4]; [] = one
                                        # stage of n_layer; a later stage may add 0: it only freezes
    target_layers: int = 0              # or plan: final depth L split into n_stages by Eq. 3
    n_stages: int = 1
    stage_tokens: list = field(default_factory=list)  # token budget per stage; [] = max_iters split
    grow_at: float = 1.0                # a stage ends after this share of its budget (the paper: 0.75);
                                        # the rest moves to the next stage
    grow_init: str = "mean"             # mean | copy | zero | stack
    grow_where: str = "upper"           # upper | intermediate | lower (thirds of the stack) | interleave
                                        # | random
    relora_every: int = 0               # >0: merge + restart adapters every this many iters of a stage
    relora_prune: float = 1.0           # share of the adapters' AdamW moments zeroed (by magnitude) at
                                        # a restart: 1 = reset them (STEP's default), ReLoRA's paper ~0.99
    merge_rounding: str = "nearest"     # nearest | stochastic: how a merge re-quantises W + s*B*A
    # optimisation
    optimizer: str = "adamw"            # adamw (fp32 state) | adamw8bit (bitsandbytes: blockwise 8-bit
                                        # moments) | galore (galore-torch: GaLore's AdamW on the layers) |
                                        # muon (torch.optim.Muon on the trained layers' matrices, one fp32
                                        # buffer each; AdamW on embeddings, head, norms, adapters)
    muon_lr: float = 0.02               # Muon's peak lr (Keller Jordan's Muon); the schedule's shape is
                                        # learning_rate's, scaled by muon_lr / learning_rate
    muon_momentum: float = 0.95         # Muon's momentum (Nesterov), as Keller Jordan's and torch's
    muon_adjust_lr: str = "original"    # original: lr * sqrt(max(1, rows/cols)) (Keller Jordan's) |
                                        # match_rms_adamw: lr * 0.2 * sqrt(max(rows, cols)) (Moonshot's
                                        # Moonlight: then muon_lr = learning_rate reuses AdamW's)
    muon_adapters: bool = False         # Muon on the frozen layers' LoRA A and B too (bench/reproduce.py's
                                        # step2-muon-lora row)
    galore_rank: int = 128
    galore_update_proj_gap: int = 200
    galore_scale: float = 0.25
    batch_size: int = 16
    gradient_accumulation_steps: int = 1
    max_iters: int = 1000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 50
    stage_warmup_iters: int = 20        # re-warmup at each stage start and each ReLoRA restart
    weight_decay: float = 0.1           # on trainable matrices (embeddings, head, new layers' linears)
    lora_weight_decay: float = 0.0      # on LoRA A and B (LoRA and ReLoRA use none)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0              # 0: no clipping
    # system: how the run executes, not what it computes (checkpoint.RUNTIME_KEYS)
    device: str = "auto"                # auto (CUDA, then Apple's MPS, then CPU) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"                 # auto (bf16 autocast on CUDA and on a CPU with AMX or AVX-512 BF16,
                                        # else fp32) | float32 | bfloat16
    compile: bool = True                # torch.compile on CUDA (never on MPS)
    compile_cpu: bool = False           # also on CPU (needs a C++ compiler): 12-18 % faster steps at
                                        # step_small, after ~40 s of compiling at each stage
    zero1: bool = False                 # shard the AdamW state over the ranks (ZeroRedundancyOptimizer)
    fsdp: bool = False                  # shard weights, gradients and AdamW state over the ranks (FSDP2;
                                        # torchrun), the frozen int8 store included: docs/distributed.md
    fsdp_checkpoint: str = "auto"       # FSDP's checkpoints: gathered (one .pt file, written by rank 0) |
                                        # sharded (a .dcp folder, torch.distributed.checkpoint: each rank
                                        # writes its rows) | auto (sharded when the weights and AdamW state
                                        # are over a quarter of rank 0's RAM)
    activation_checkpointing: bool = False  # keep each block's input only; recompute it in the backward
    loss_chunk: int = 0                 # >0: the loss this many tokens at a time, its gradients formed in the
                                        # forward (stepgpt/losses.py), so the full logits never exist
    sync_check_every: int = 0           # >0: also check every N steps that all ranks hold the same weights
    dist_timeout: float = 300.0         # seconds a rank waits in a collective for the others before it gives
                                        # up (a rank gone or hung; NCCL's default is 600, gloo's 1800): above
                                        # the longest any rank works alone (a gathered checkpoint's write)
    # tracking: what metrics.jsonl holds, also sent to TensorBoard and/or W&B (rank 0; off by default)
    tensorboard_dir: str = ""           # a folder for TensorBoard's event files ("": none); pip install
                                        # tensorboard; then: tensorboard --logdir <that folder>
    wandb_log: bool = False             # log to Weights & Biases (pip install wandb); offline, saying so,
                                        # when no API key is configured or the server does not answer
    wandb_project: str = "step-gpt"
    wandb_run_name: str = ""            # "": out_dir's name

    def __post_init__(self):
        if self.frozen_layers:
            raise UserError("frozen_layers is set by the stages, not by a config; remove it")
        super().__post_init__()
        for key in ("batch_size", "gradient_accumulation_steps", "eval_interval", "eval_iters",
                    "log_interval", "n_stages", "keep_checkpoints", "galore_rank", "galore_update_proj_gap"):
            if getattr(self, key) < 1:
                raise UserError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("sync_check_every", "loss_chunk", "warmup_iters", "stage_warmup_iters", "relora_every",
                    "stop_at", "sample_tokens", "target_layers", "max_iters", "min_lr", "weight_decay",
                    "lora_weight_decay", "grad_clip", "learning_rate", "galore_scale", "eval_tokens",
                    "dist_timeout", "muon_lr"):
            v = getattr(self, key)
            positive = key in ("learning_rate", "galore_scale", "dist_timeout", "muon_lr")
            if not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise UserError(f"{key}={v} must be a finite number {'> 0' if positive else '>= 0'}")
        named = [o for o in CHOICES["optimizer"] if o in re.split(r"[^a-z0-9]+", str(self.optimizer).lower())]
        if len(named) > 1:   # e.g. muon+adamw8bit
            raise UserError(f"optimizer={self.optimizer!r}: one optimizer per run, of {', '.join(named)} "
                            f"(Muon takes fp32 AdamW for the rest; Muon with 8-bit or GaLore state is not "
                            f"built)")
        for key, options in CHOICES.items():
            if getattr(self, key) not in options:
                raise UserError(f"{key}={getattr(self, key)!r}: use one of {', '.join(options)}")
        for key, lo, hi, what in (("beta1", 0, 1, "[0, 1), e.g. 0.9"), ("beta2", 0, 1, "[0, 1), e.g. 0.95"),
                                  ("muon_momentum", 0, 1, "[0, 1), e.g. 0.95"),
                                  ("relora_prune", 0, 1.0000001, "[0, 1]"),
                                  ("grow_at", 1e-12, 1.0000001, "(0, 1]: the share of a stage's budget")):
            if not lo <= getattr(self, key) < hi:
                raise UserError(f"{key}={getattr(self, key)} must be in {what}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise UserError(f"device={self.device!r}: use auto, cpu, cuda, cuda:N or mps")
        if self.optimizer == "adamw8bit" and (self.zero1 or self.relora_prune < 1):
            raise UserError("optimizer=adamw8bit: its moments are 8-bit blocks, so ZeRO-1 cannot shard them "
                            "and relora_prune cannot zero single entries; use zero1=False and "
                            "relora_prune=1, or optimizer=adamw")
        if self.fsdp and self.zero1:
            raise UserError("fsdp=True shards the AdamW state already (with the weights and gradients); "
                            "zero1=True is DDP's optimizer sharding: use one of them")
        if self.fsdp and self.optimizer == "muon":
            raise UserError("optimizer=muon orthogonalises each matrix whole, which fsdp=True shards by "
                            "rows: train it with DDP (zero1=True shards its state by whole tensors)")
        if self.fsdp and (self.optimizer != "adamw" or self.relora_prune < 1):
            raise UserError(f"fsdp=True runs optimizer=adamw with relora_prune=1 (optimizer="
                            f"{self.optimizer!r} and relora_prune={self.relora_prune} need whole tensors)")
        if self.fsdp_checkpoint == "sharded" and not self.fsdp:
            raise UserError("fsdp_checkpoint='sharded' has each FSDP rank write its rows: set fsdp=True too, "
                            "or drop it (other runs write one file)")
        if self.optimizer == "galore" and self.zero1:
            raise UserError("optimizer=galore does not shard its state: use zero1=False")
        if self.min_lr > self.learning_rate:
            raise UserError(f"min_lr={self.min_lr} is above learning_rate={self.learning_rate}; the cosine "
                            f"decays down to min_lr")
        if self.init_from not in INITS and not os.path.exists(self.init_from.removeprefix("hf:")):
            raise UserError(f"init_from={self.init_from!r}: use 'auto', 'scratch', 'resume', "
                            f"'resume_previous', the path of a checkpoint (a file, or a run folder for its "
                            f"newest) or hf:PATH (a Hugging Face LLaMA folder)")
        if any(not isinstance(t, int) or t < 1 for t in self.stage_tokens):
            raise UserError(f"stage_tokens={self.stage_tokens}: every stage needs a positive whole number "
                            f"of tokens")
        if not re.fullmatch(r"[^/\\#?%:]{1,128}", self.wandb_project):
            raise UserError(f"wandb_project={self.wandb_project!r}: W&B takes 1 to 128 characters, none of "
                            f"/ \\ # ? % :")
        if self.max_iters < 1 and not self.stage_tokens:
            raise UserError("max_iters must be >= 1 (or give stage_tokens)")
        self._check_stages()

    def _check_stages(self):
        layers = self.stage_layers
        if layers and (any(not isinstance(n, int) or n < 0 for n in layers) or layers[0] < 1):
            raise UserError(f"stage_layers={layers}: the first stage needs at least one layer, later ones "
                            f"0 or more")
        if layers and self.target_layers and sum(layers) != self.target_layers:
            raise UserError(f"stage_layers={layers} sum to {sum(layers)}, not "
                            f"target_layers={self.target_layers}; fix one of them")
        if not layers and self.n_stages > 1 and not self.target_layers:
            raise UserError("n_stages > 1 needs target_layers (planned) or stage_layers (explicit)")
        if self.target_layers and not layers and self.n_stages > self.target_layers:
            raise UserError(f"n_stages={self.n_stages} must be between 1 and "
                            f"target_layers={self.target_layers}")
        if self.stage_tokens and len(self.stage_tokens) != grow.stage_count(self):
            raise UserError(f"stage_tokens has {len(self.stage_tokens)} entries for "
                            f"{grow.stage_count(self)} stages")


INITS = ("auto", "scratch", "resume", "resume_previous")
CHOICES = {"dtype": ("auto", "float32", "bfloat16"), "merge_rounding": ("nearest", "stochastic"),
           "optimizer": ("adamw", "adamw8bit", "galore", "muon"), "grow_init": grow.INITS,
           "grow_where": grow.PLACEMENTS, "fsdp_checkpoint": ("auto", "gathered", "sharded"),
           "muon_adjust_lr": ("original", "match_rms_adamw")}
def _coerce(key, value, default):
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        seq = (list, tuple)
        ok = type(value) is type(default) or (isinstance(default, seq) and isinstance(value, seq))
    else:  # an int where a float is expected is fine (--learning_rate=1); a float for an int is not
        ok = type(value) is type(default) or (type(default) is float and type(value) is int)
    if not ok:
        raise UserError(f"config key {key!r} wants a {type(default).__name__}, got {value!r}; "
                        f"write it like {default!r}")
    return float(value) if type(default) is float else list(value) if isinstance(default, list) else value


def read_config_file(path):
    """The assignments of a config file. It runs as plain Python with __file__ set, so a config can
    build on another one next to it from any working directory; names starting with '_' and
    imported modules are not keys."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found (see config/ for examples)")
    scope = {"__file__": os.path.abspath(path)}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)
    except Exception as e:
        raise UserError(f"config file {path} does not run: {type(e).__name__}: {e}") from None
    return {k: v for k, v in scope.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def load_config(argv):
    """argv: config files (plain Python assignments) and --key=value overrides, applied in order."""
    # the declared defaults (not TrainConfig()'s resolved values: ffn_hidden=0 must stay "chosen for you")
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                for f in fields(TrainConfig)}
    values = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise UserError(f"override {arg!r} needs a value: write --key=value")
            key, text = arg[2:].split("=", 1)   # split once: a value may contain '='
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text                    # a bare word is a string
            updates = {key: value}
        else:
            updates = read_config_file(arg)
        for key, value in updates.items():
            if key not in values:
                raise UserError(f"unknown config key {key!r}; every key is listed in TrainConfig "
                                f"(stepgpt/config.py) and GPTConfig (model.py)")
            values[key] = _coerce(key, value, defaults[key])
    return TrainConfig(**values)
