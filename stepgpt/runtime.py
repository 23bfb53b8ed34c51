"""The processes of a training run, beside the loop in train.py: the out_dir lock (one run per
folder), signals (a pre-empted job saves and stops) and the check that all DDP ranks hold the same
weights. Checkpoints are stepgpt/checkpoint.py; what a run prints and records, stepgpt/monitor.py."""
import os
import signal
import socket
import time

import torch
import torch.distributed as dist

from stepgpt.checkpoint import tensor_digest
from stepgpt.errors import UserError

try:
    import fcntl
except ImportError:   # Windows: no advisory locks, out_dir is not guarded
    fcntl = None


class OutDirLock:
    """out_dir/run.lock, held while a run lives, so that a second run into the same out_dir (a job
    launched twice, a requeue while the old job still dies) stops at once. flock is released by the
    OS when the process dies: a killed run leaves nothing stuck. Also proves out_dir writable."""

    def __init__(self, out_dir):
        self.f = None
        try:
            os.makedirs(out_dir, exist_ok=True)
            f = open(os.path.join(out_dir, "run.lock"), "a+")
        except OSError as e:
            raise UserError(f"out_dir={out_dir!r} is not writable ({e.strerror or e}); "
                            f"choose another --out_dir") from None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise UserError(f"out_dir={out_dir!r} is in use by another run ({holder}); wait for it to "
                                f"end or stop it, or choose another --out_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self.f = f
        for name in os.listdir(out_dir):   # a save killed halfway left its temp file (ours now)
            if name.endswith(".pt.tmp"):
                os.remove(os.path.join(out_dir, name))

    def release(self):
        if self.f is not None:
            self.f.close()   # closing the file releases the lock
            self.f = None


def check_replicas(run, model, when):
    """All ranks must hold bit-identical weights (DDP does not re-broadcast the int8 buffers:
    broadcast_buffers=False). A digest of every parameter and buffer, compared across ranks."""
    if run.world == 1:
        return
    digests = [None] * run.world
    dist.all_gather_object(digests, tensor_digest(model.state_dict()))
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"ranks {bad} hold other weights than rank 0 {when}; the ranks diverged (a bug: "
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


