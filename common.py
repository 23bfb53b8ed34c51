"""What every script shares, at the bottom of the tree (it imports nothing of the project):

  UserError, run_cli   bad input (a config, data, a checkpoint) ends a script with one line, no traceback
  TrainConfig          every key of a run and its default; load_config() reads config files + overrides
  checkpoints          save_checkpoint() writes atomically, load_checkpoint() refuses damaged files

It is a module of its own because train.py, grow.py and sample.py all read config files or
checkpoints, and train.py sits above grow.py: keeping these here lets every import point down.
"""
import ast
import hashlib
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
    init_from: str = "scratch"          # 'scratch', 'resume' (out_dir's newest ckpt-<iter>.pt), 'resume_previous'
                                        # (the one before it), a checkpoint path (weights only) or 'hf:PATH'
                                        # (stage 1 from a Hugging Face LLaMA folder)
    eval_interval: int = 100
    eval_iters: int = 20
    log_interval: int = 10
    keep_checkpoints: int = 2           # the newest k checkpoints stay in out_dir (ckpt-<iter>.pt)
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
    lora_rank: int = 16                 # adapters on frozen layers (0: none, the paper's ablation)
    lora_alpha: float = 32.0
    frozen_dtype: str = "int8"          # frozen linears in int8 + row scale (ours) or bf16 (the paper's)
    # STEP stages
    stage_layers: list = field(default_factory=list)  # layers added per stage, e.g. [4, 4]; [] = vanilla n_layer;
                                        # a later stage may add 0: it only freezes (ReLoRA: [6, 0])
    target_layers: int = 0              # or plan: final depth L split into n_stages by grow.plan_stages
    n_stages: int = 1
    stage_tokens: list = field(default_factory=list)  # token budget per stage; [] = max_iters split evenly
    grow_at: float = 1.0                # a stage ends after this share of its budget (the paper: 0.75), the rest
                                        # moves to the next stage
    grow_init: str = "mean"             # mean | copy | zero | stack
    grow_where: str = "upper"           # upper | intermediate | lower (thirds of the stack) | interleave | random
    train_embeddings: bool = True       # embeddings, final norm and head trainable in every stage
    relora_every: int = 0               # >0: merge + restart adapters every this many iters of a stage
    relora_prune: float = 1.0           # share of the adapters' AdamW moments zeroed (by magnitude) at a
                                        # restart: 1 = reset them (STEP's default), ReLoRA's paper ~0.99
    merge_rounding: str = "nearest"     # nearest | stochastic: how a merge re-quantises W + s*B*A
    # optimisation
    optimizer: str = "adamw"            # adamw (fp32 state) | adamw8bit (pip install bitsandbytes: blockwise
                                        # 8-bit moments) | galore (pip install galore-torch: GaLore's AdamW
                                        # on the layers' matrices)
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
    # system
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                 # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    compile: bool = True                # torch.compile on CUDA
    compile_cpu: bool = False           # also on CPU (needs a C++ compiler): 12-18 % faster steps at
                                        # step_small, after ~40 s of compiling at each stage
    zero1: bool = False                 # shard the AdamW state over the ranks (ZeroRedundancyOptimizer)
    activation_checkpointing: bool = False  # recompute each block in the backward (frozen ones too)
    loss_chunk: int = 0                 # >0: cross-entropy this many tokens at a time, never the full logits
    sync_check_every: int = 0           # >0: also check every N steps that all ranks hold the same weights


CHOICES = {"dtype": ("auto", "float32", "bfloat16"), "merge_rounding": ("nearest", "stochastic"),
           "optimizer": ("adamw", "adamw8bit", "galore"), "frozen_dtype": ("int8", "bf16")}
AT_LEAST_ONE = ("batch_size", "gradient_accumulation_steps", "block_size", "eval_interval", "eval_iters",
                "log_interval", "n_layer", "n_head", "n_embd", "n_stages", "keep_checkpoints", "galore_rank",
                "galore_update_proj_gap")
NOT_NEGATIVE = ("lora_rank", "vocab_size", "sync_check_every", "warmup_iters", "stage_warmup_iters", "relora_every", "stop_at",
                "sample_tokens", "ffn_hidden", "target_layers", "max_iters", "min_lr", "weight_decay", "lora_weight_decay", "grad_clip",
                "loss_chunk")
POSITIVE = ("learning_rate", "lora_alpha", "rope_theta", "norm_eps", "galore_scale")


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
    if not 0 < cfg.grow_at <= 1:
        raise UserError(f"grow_at={cfg.grow_at} must be in (0, 1]: the share of a stage's budget before the next begins")
    if not 0 <= cfg.relora_prune <= 1:
        raise UserError(f"relora_prune={cfg.relora_prune} must be in [0, 1]")
    if cfg.optimizer == "adamw8bit" and (cfg.zero1 or cfg.relora_prune < 1):
        raise UserError("optimizer=adamw8bit: its moments are 8-bit blocks, so ZeRO-1 cannot shard them and relora_prune "
                        "cannot zero single entries; use zero1=False and relora_prune=1, or optimizer=adamw")
    if cfg.min_lr > cfg.learning_rate:
        raise UserError(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}; the cosine decays down to min_lr")
    for key, options in CHOICES.items():
        if getattr(cfg, key) not in options:
            raise UserError(f"{key}={getattr(cfg, key)!r}: use one of {', '.join(options)}")
    if cfg.init_from not in ("scratch", "resume", "resume_previous") and not os.path.exists(cfg.init_from.removeprefix("hf:")):
        raise UserError(f"init_from={cfg.init_from!r}: use 'scratch', 'resume', 'resume_previous', the path of a "
                        f"checkpoint (a file, or a run folder for its newest) or hf:PATH (a Hugging Face LLaMA folder)")
    if any(not isinstance(t, int) or t < 1 for t in cfg.stage_tokens):
        raise UserError(f"stage_tokens={cfg.stage_tokens}: every stage needs a positive whole number of tokens")
    if cfg.max_iters < 1 and not cfg.stage_tokens:
        raise UserError("max_iters must be >= 1 (or give stage_tokens)")


# ----------------------------------------------------------------------------------------------
# checkpoints
#
# A run keeps its newest keep_checkpoints files, out_dir/ckpt-<iteration>.pt. Each file is a short
# header (a magic line and the BLAKE2b digest of the payload), then the torch.save payload. It is
# written to a temp file, flushed to disk and renamed, so a crash or kill at any moment leaves the
# older files whole; the digest catches a file damaged later (a bad disk, a partial copy).

MAGIC = b"step-gpt checkpoint v1\n"
DIGEST_HEX = 64


class _HashingWriter:
    """A file wrapper that hashes what torch.save writes through it."""

    def __init__(self, f):
        self.f, self.hash = f, hashlib.blake2b(digest_size=DIGEST_HEX // 2)

    def write(self, b):
        self.hash.update(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def checkpoint_path(out_dir, it):
    return os.path.join(out_dir, f"ckpt-{it:08d}.pt")


def checkpoint_files(out_dir):
    """The checkpoints of a run folder, newest (highest iteration) first."""
    if not os.path.isdir(out_dir):
        return []
    names = [n for n in os.listdir(out_dir) if n.startswith("ckpt-") and n.endswith(".pt") and n[5:-3].isdigit()]
    return [os.path.join(out_dir, n) for n in sorted(names, reverse=True)]


def save_checkpoint(path, state, keep=0):
    """Write `state` to `path` atomically with its digest; then, with keep > 0, delete all but the
    newest `keep` checkpoints of the folder. A full disk leaves the older files as they were."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + b"0" * DIGEST_HEX + b"\n")
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.seek(len(MAGIC))
            f.write(writer.hash.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        older = [p for p in checkpoint_files(os.path.dirname(path) or ".") if p != path]
        raise UserError(f"could not write checkpoint {path} ({e.strerror or e}); "
                        + (f"{older[0]} is intact: free space, then resume" if older else "no earlier checkpoint exists"))
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:   # the rename itself must reach the disk before older files are deleted
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep:
        for old in checkpoint_files(os.path.dirname(path) or ".")[keep:]:
            os.remove(old)


def verify_checkpoint(path):
    """-> None if the file is whole, else why not (one phrase)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + DIGEST_HEX + 1)
        if not head.startswith(MAGIC):
            return "not a checkpoint of this project (no step-gpt header)"
        h = hashlib.blake2b(digest_size=DIGEST_HEX // 2)
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    if h.hexdigest().encode() != head[len(MAGIC):-1]:
        return "checksum mismatch: the file is truncated or damaged"
    return None


def load_checkpoint(path):
    """A checkpoint file, verified; or the newest one of a run folder."""
    if os.path.isdir(path):
        files = checkpoint_files(path)
        if not files:
            raise UserError(f"no checkpoint in {path}; train first, or use init_from=scratch")
        path = files[0]
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train first, or use init_from=scratch")
    why = verify_checkpoint(path)
    if why:
        raise UserError(f"checkpoint {path} is unusable: {why}")
    with open(path, "rb") as f:
        f.seek(len(MAGIC) + DIGEST_HEX + 1)
        ckpt = torch.load(f, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no model/model_args)")
    return ckpt


def resume_checkpoint(out_dir, previous=False):
    """The checkpoint a resumed run continues from: the newest of out_dir, or with `previous` the
    one before it. A damaged newest file is an error that names the fallback, never a silent
    switch to it. -> (path, checkpoint)."""
    files = checkpoint_files(out_dir)
    if len(files) < 1 + previous:
        raise UserError(f"no {'earlier ' if previous else ''}checkpoint in {out_dir} to resume from; "
                        f"train first, or use init_from=scratch")
    path = files[int(previous)]
    why = verify_checkpoint(path)
    if why:
        hint = (f"resume from the one before it, {files[int(previous) + 1]}, with --init_from=resume_previous"
                if not previous and len(files) > 1 else "no earlier checkpoint is left: start with init_from=scratch")
        raise UserError(f"checkpoint {path} is unusable ({why}); {hint}")
    return path, load_checkpoint(path)
