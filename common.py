"""What every script shares, at the bottom of the tree (it imports nothing of the project):

  UserError, run_cli   bad input (a config, data, a checkpoint) ends a script with one line, no traceback
  TrainConfig          every key of a run and its default; load_config() reads config files + overrides
  checkpoints          save_checkpoint() writes atomically, load_checkpoint() refuses damaged files

It is a module of its own because train.py, grow.py and sample.py all read config files or
checkpoints, and train.py sits above grow.py: keeping these here lets every import point down.
"""
import ast
import math
import os
import sys
import types
from dataclasses import asdict, dataclass, field

import torch


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint): printed as one line, no traceback."""


def run_cli(main):
    """main(argv) for a script: a UserError ends it with one line on stderr and exit status 2."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------
# the run configuration

@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    data_dir: str = "data/shakespeare"  # train.bin, val.bin, meta.json (data/prepare.py)
    init_from: str = "scratch"          # 'scratch', 'resume' (out_dir/ckpt.pt) or a checkpoint path (weights only)
    eval_interval: int = 100
    eval_iters: int = 20
    log_interval: int = 10
    eval_only: bool = False
    dry_run: bool = False               # print the resolved config, model and stage plan, then exit
    stop_at: int = 0                    # >0: save and stop at this iteration, as a preempted job would
    sample_tokens: int = 200            # a sample written to out_dir/sample.txt at the end (0: none)
    seed: int = 1337
    # model (the final depth comes from the stages below); every GPTConfig field of the same name
    vocab_size: int = 0                 # the data's vocabulary this config is for (checked); 0: whatever the data has
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    ffn_hidden: int = 0                 # 0: about 8/3 * n_embd rounded up to 64
    block_size: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    lora_rank: int = 16
    lora_alpha: float = 32.0
    # STEP stages
    stage_layers: list = field(default_factory=list)  # layers added per stage, e.g. [4, 4]; [] = vanilla n_layer
    target_layers: int = 0              # or plan: final depth L split into n_stages by grow.plan_stages
    n_stages: int = 1
    stage_tokens: list = field(default_factory=list)  # token budget per stage; [] = max_iters split evenly
    grow_init: str = "mean"             # mean | copy | zero | stack
    grow_where: str = "upper"           # upper | lower | interleave | random
    train_embeddings: bool = True       # embeddings, final norm and head trainable in every stage
    relora_every: int = 0               # >0: merge + restart adapters every this many iters of a stage
    merge_rounding: str = "nearest"     # nearest | stochastic: how a merge re-quantises W + s*B*A
    # optimisation
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
    # system
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                 # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    compile: bool = True                # torch.compile on CUDA; always off on CPU (said at start)


CHOICES = {"dtype": ("auto", "float32", "bfloat16"), "merge_rounding": ("nearest", "stochastic")}
AT_LEAST_ONE = ("batch_size", "gradient_accumulation_steps", "block_size", "eval_interval", "eval_iters",
                "log_interval", "n_layer", "n_head", "n_embd", "n_stages", "lora_rank")
NOT_NEGATIVE = ("vocab_size", "warmup_iters", "stage_warmup_iters", "relora_every", "stop_at", "sample_tokens", "ffn_hidden",
                "target_layers", "max_iters", "min_lr", "weight_decay", "lora_weight_decay", "grad_clip")
POSITIVE = ("learning_rate", "lora_alpha", "rope_theta", "norm_eps")


def _coerce(key, value, default):
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        ok = type(value) is type(default) or (isinstance(default, list) and isinstance(value, tuple))
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
        raise UserError(f"config file {path} does not run: {type(e).__name__}: {e}")
    return {k: v for k, v in scope.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def load_config(argv):
    """argv: config files (plain Python assignments) and --key=value overrides, applied in order."""
    defaults = TrainConfig()
    values = asdict(defaults)
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
                raise UserError(f"unknown config key {key!r}; every key is listed in TrainConfig in common.py")
            values[key] = _coerce(key, value, getattr(defaults, key))
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg):
    """Range checks of every key that has one; STEP's stage keys are checked by grow.check_stages."""
    for key in AT_LEAST_ONE:
        if getattr(cfg, key) < 1:
            raise UserError(f"{key}={getattr(cfg, key)} must be >= 1")
    for key in NOT_NEGATIVE + POSITIVE:
        v = getattr(cfg, key)
        if not math.isfinite(v) or v < 0 or (key in POSITIVE and v == 0):
            raise UserError(f"{key}={v} must be a finite number {'> 0' if key in POSITIVE else '>= 0'}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, key) < 1:
            raise UserError(f"{key}={getattr(cfg, key)} must be in [0, 1), e.g. 0.9 or 0.95")
    if cfg.min_lr > cfg.learning_rate:
        raise UserError(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}; the cosine decays down to min_lr")
    for key, options in CHOICES.items():
        if getattr(cfg, key) not in options:
            raise UserError(f"{key}={getattr(cfg, key)!r}: use one of {', '.join(options)}")
    if cfg.init_from not in ("scratch", "resume") and not os.path.isfile(cfg.init_from):
        raise UserError(f"init_from={cfg.init_from!r}: use 'scratch', 'resume' or the path of a checkpoint")
    if any(not isinstance(t, int) or t < 1 for t in cfg.stage_tokens):
        raise UserError(f"stage_tokens={cfg.stage_tokens}: every stage needs a positive whole number of tokens")
    if cfg.max_iters < 1 and not cfg.stage_tokens:
        raise UserError("max_iters must be >= 1 (or give stage_tokens)")


# ----------------------------------------------------------------------------------------------
# checkpoints

def save_checkpoint(path, state):
    """Write to a temp file in the same folder, flush to disk, then rename: a crash or kill at any
    moment leaves either the old checkpoint or the new one, never a torn file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (corrupt or truncated: {type(e).__name__}); "
                        f"delete it and start with init_from=scratch, or restore a copy")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    return ckpt
