"""How a training run executes, beside the loop in train.py: its precision, signals (a pre-empted job
saves and stops) and the check that all DDP ranks hold the same weights. The out_dir lock is stepgpt/lock.py,
checkpoints stepgpt/checkpoint.py, what a run prints and records stepgpt/monitor.py."""
import re
import signal
from contextlib import nullcontext

import torch
import torch.distributed as dist

from stepgpt import sharding
from stepgpt.checkpoint import tensor_digest
from stepgpt.errors import UserError


def pick_device(name, local_rank, ddp):
    """The torch device name of `device=name` for this process; auto: CUDA (this rank's GPU), then
    Apple's MPS (as nanoGPT's --device=mps, the plain-PyTorch path), then the CPU."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", name):
        raise UserError(f"device={name!r}: use auto, cpu, cuda, cuda:N or mps")
    if name == "auto":
        name = (f"cuda:{local_rank}" if torch.cuda.is_available()
                else "mps" if torch.backends.mps.is_available() else "cpu")
    elif name == "cuda" and ddp:
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name} but CUDA is not available; use --device=cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available (Apple silicon, macOS 14 or later); "
                        "use --device=cpu")
    return name


def precision(cfg, device):
    """-> (dtype, autocast context, compile?) of a run on `device`; allows TF32 (train.py's runs and
    bench/step_time.py's timed steps alike). Compiled on CUDA, on the CPU only when asked (compile_cpu)
    and a C++ compiler is there, never on MPS."""
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "bfloat16" and device.type == "cpu":
        raise UserError("dtype=bfloat16 autocast is for CUDA and MPS here; use --dtype=float32 on CPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device.type, torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    compiled = cfg.compile and (device.type == "cuda" or device.type == "cpu" and cfg.compile_cpu)
    if compiled and device.type == "cpu" and not has_cpp_compiler():
        print("compile_cpu=True: torch.compile needs a C++ compiler on the CPU (g++, clang++ or $CXX; MSVC "
              "on Windows) and none was found; training eager", flush=True)
        compiled = False
    return dtype, autocast, compiled


def has_cpp_compiler():
    """Whether inductor finds the C++ compiler it builds CPU kernels with (its own search)."""
    from torch._inductor import cpp_builder, exc
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return False
    return True


def check_replicas(run, model, when):
    """All ranks must hold bit-identical weights (DDP does not re-broadcast the frozen int8 store, which
    no gradient touches). A digest of every parameter and buffer, compared across ranks. Under FSDP
    no tensor has replicas (each row lives on one rank): the ranks must hold the same model, its
    tree, shapes and config (sharding.structure_digest)."""
    if run.world == 1:
        return
    digests = [None] * run.world
    mine = sharding.structure_digest(model) if sharding.sharded(model) else tensor_digest(model.state_dict())
    dist.all_gather_object(digests, mine)
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        what = "another model" if sharding.sharded(model) else "other weights"
        raise RuntimeError(f"ranks {bad} hold {what} than rank 0 {when}; the ranks diverged (a bug: "
                           f"please report it with the config)")


class StopRequest:
    """SIGTERM or SIGINT (a pre-empted job, Ctrl-C) asks the loop to finish its step, save and exit
    cleanly; under DDP the ranks agree on the step to stop at."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def requested(self, run):
        flag = torch.tensor(float(self.signal is not None), device=run.device)
        if run.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


