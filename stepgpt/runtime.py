"""The processes of a training run, beside the loop in train.py: signals (a pre-empted job saves and
stops) and the check that all DDP ranks hold the same weights. The out_dir lock is stepgpt/lock.py,
checkpoints stepgpt/checkpoint.py, what a run prints and records stepgpt/monitor.py."""
import signal

import torch
import torch.distributed as dist

from stepgpt.checkpoint import tensor_digest


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


