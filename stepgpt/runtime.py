"""How a training run executes, beside the loop in train.py: its ranks, device and precision, the
world sizes it can run on, signals (a pre-empted job saves and stops), the check that all DDP ranks
hold the same weights, and what the ranks tell each other when one is gone (Peers). The out_dir
lock is stepgpt/lock.py, checkpoints stepgpt/checkpoint.py, what a run prints and records
stepgpt/monitor.py."""
import atexit
import os
import re
import signal
import threading
import time
import uuid
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from data.load import eval_batches
from stepgpt import sharding
from stepgpt.checkpoint import checkpoint_files, tensor_digest, written
from stepgpt.errors import PeerLost, UserError


def ranks():
    """-> (under torchrun?, rank, local rank, world size), from torchrun's environment."""
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 0, 1
    return (True,) + tuple(int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def check_world(cfg, world, data):
    """Whether `world` ranks can run this run (before any work): each rank does an equal share of a
    step's gradient_accumulation_steps micro-steps, and under FSDP as many eval batches as every
    other rank (each forward gathers every block from all ranks). The batches are drawn by their
    global index, so every world size that divides them trains on the same tokens: a run or a
    checkpoint moves between them. Else one line naming the world sizes that can."""
    steps, key = cfg.gradient_accumulation_steps, "eval_tokens" if cfg.eval_tokens else "eval_iters"
    evals = (eval_batches(data, cfg.eval_tokens, cfg.batch_size, cfg.block_size) if cfg.eval_tokens
             else cfg.eval_iters)

    def fits(m):   # a world of 1 under FSDP is refused apart (sharding.check: it needs torchrun)
        return steps % m == 0 and (not cfg.fsdp or m == 1 or evals % m == 0)
    if fits(world):
        return
    why = (f"gradient_accumulation_steps={steps} does not divide over {world} ranks (each does an equal "
           f"share of a step's micro-steps)" if steps % world else
           f"fsdp=True: {key}={getattr(cfg, key)} makes {evals} eval batches, not a multiple of the world "
           f"size {world} (each forward gathers every block from all ranks, so all ranks must run as many)")
    can = [str(m) for m in range(2 if cfg.fsdp else 1, steps + 1) if fits(m)]
    where = (f"this run runs on {', '.join(can[:-1])}{' or ' if len(can) > 1 else ''}{can[-1]} ranks, and "
             f"its checkpoints resume on any of them" if can else
             f"no world size over 1 divides both: change {key} or gradient_accumulation_steps")
    raise UserError(f"{why}; {where}")


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
    bench/step_time.py's timed steps alike). dtype=bfloat16 is bf16 autocast on CPU too: with
    compile_cpu it runs a GPU run's precision and compilation on a CPU. Compiled on CUDA, on the CPU
    only when asked (compile_cpu) and a C++ compiler is there, never on MPS. dtype=auto: bf16 autocast
    on CUDA and on a CPU that computes bf16 natively (native_bf16), fp32 elsewhere."""
    bf16 = device.type == "cuda" or device.type == "cpu" and native_bf16() is not None
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if bf16 else "float32")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device.type, torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    compiled = cfg.compile and (device.type == "cuda" or device.type == "cpu" and cfg.compile_cpu)
    if compiled and device.type == "cpu" and not has_cpp_compiler():
        print("compile_cpu=True: torch.compile needs a C++ compiler on the CPU (g++, clang++ or $CXX; MSVC "
              "on Windows) and none was found; training eager", flush=True)
        compiled = False
    return dtype, autocast, compiled


def native_bf16():
    """The instructions this CPU computes bf16 matmuls with (AMX, AVX-512 BF16), or None: without them
    PyTorch emulates bf16 in fp32 and a bf16 step is slower than an fp32 one (bench/RESULTS.md)."""
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    return next((name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)()), None)


def has_cpp_compiler():
    """Whether inductor finds the C++ compiler it builds CPU kernels with (its own search)."""
    from torch._inductor import cpp_builder, exc
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return False
    return True


def start_group(cfg, device, decided):
    """The process group (NCCL on CUDA, gloo on CPU), whose collectives give up after dist_timeout
    seconds (a rank that died or hangs must not hold the others for NCCL's 10 minutes or gloo's
    30); rank 0's `decided` (what init_from=auto does: checkpoint.claim) given to every rank; and
    the roll call a failed collective starts (Peers). -> (decided, Peers)."""
    timeout, store = timedelta(seconds=cfg.dist_timeout), {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store through all its restarts (torch >= 2.5), and the process
        # group's keys carry no attempt: a restarted group could read its predecessor's addresses
        # (gloo's pairs, NCCL's unique id) and hang or fail to connect (pytorch/pytorch#135712). Each
        # attempt's keys are its own, as torch made them before it shared the store.
        shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dict(store=dist.PrefixStore(f"step-gpt/attempt-{attempt}/", shared),
                     rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout, **store)
    got = [decided, uuid.uuid4().hex]   # the roll call's keys are this process group's alone
    dist.broadcast_object_list(got, src=0)
    return got[0], Peers(dist.get_rank(), dist.get_world_size(), got[1])


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




# seconds a rank whose collective failed waits for the others to answer its roll call
ROLL_CALL = 3


class Peers:
    """What the ranks of a run can still tell each other when a collective fails: through the
    rendezvous store (torchrun's agent holds it, so it outlives every worker; outside torchrun,
    rank 0's process does), each rank answers a roll call from a thread of its own, and a rank
    that stops on an error of its own posts it there first. A rank whose collective failed calls
    the roll: the ranks that do not answer are gone (killed, their node lost, or hung)."""

    def __init__(self, rank, world, nonce):
        self.rank, self.world, self.prefix = rank, world, f"step-gpt/{nonce}/"
        self.where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()
        # a thread still waiting in the store's C++ code as the interpreter ends aborts the process
        atexit.register(self.close)

    def _store(self, seconds):
        return dist.TCPStore(*self.where, is_master=False, timeout=timedelta(seconds=seconds))

    def _answer(self):
        """The thread: asleep in the store until a roll call (or the run's end) wakes it. It answers
        while the main thread waits in a collective (which releases the GIL)."""
        try:
            store = self._store(365 * 86400)
            store.wait([f"{self.prefix}wake/{self.rank}"])
            store.set(f"{self.prefix}here/{self.rank}", "")
        except dist.DistError:   # the store is gone: the run is over
            pass

    def close(self):
        """The run ended: this rank's thread stops waiting (it answers, as it would a roll call)."""
        if self.thread.is_alive():
            try:
                self._store(ROLL_CALL).set(f"{self.prefix}wake/{self.rank}", "end")
            except dist.DistError:   # the store is gone: so is the thread's wait
                pass
            self.thread.join(ROLL_CALL)

    def post(self, error):
        """This rank stops on `error` (its own: a full disk, a bug): the others' lines will say so."""
        try:
            self._store(ROLL_CALL).set(f"{self.prefix}failed/{self.rank}", error)
        except dist.DistError:
            pass

    def roll_call(self):
        """-> ({rank: the error it posted}, [the ranks that did not answer]); None if the store
        itself does not answer."""
        try:
            store = self._store(ROLL_CALL)
            for r in range(self.world):
                store.set(f"{self.prefix}wake/{r}", "call")
            here, end = [], time.monotonic() + ROLL_CALL
            while len(here) < self.world and time.monotonic() < end:
                time.sleep(0.1)
                here = [r for r in range(self.world) if store.check([f"{self.prefix}here/{r}"])]
            failed = {r: store.get(f"{self.prefix}failed/{r}").decode() for r in range(self.world)
                      if store.check([f"{self.prefix}failed/{r}"])}
        except dist.DistError:
            return None
        return failed, [r for r in range(self.world) if r not in here and r not in failed]


def end(run, error):
    """A run's end (Run.__exit__), on `error` or None: its log closed and out_dir's lock released;
    under torchrun, a rank gone ends this one with a line that names it (PeerLost), not with the
    failed collective's traceback."""
    line = _after_failure(run, error)
    if run.peers:
        run.peers.close()
    if run.log:
        run.log.close(failed=error is not None)
    if run.lock:
        run.lock.release()
    if line:
        raise PeerLost(line) from None


def _after_failure(run, error):
    """As a run of several ranks ends on `error`: a rank's own error is posted for the others; a
    failed collective (the rank it waited for is gone) is a roll call, and the line that names the
    rank gone, the newest checkpoint, and that a restart continues from it. SIGTERM is held
    meanwhile: torchrun's agent sends it to the survivors as soon as a worker dies.
    -> that line, or None (the error stands as it is)."""
    peers = run.peers
    if peers is None or not isinstance(error, Exception):   # no error; Ctrl-C outside the loop
        return None
    if isinstance(error, UserError):
        peers.post(str(error))
        return None
    held = signal.signal(signal.SIGTERM, lambda *a: None)   # kept so until the line is out, if one is
    try:
        found = peers.roll_call()
    except BaseException:
        signal.signal(signal.SIGTERM, held)
        raise
    files = [p for p in checkpoint_files(run.cfg.out_dir) if written(p)]
    then = (f"the newest checkpoint is {files[0]}: a restart (torchrun --max-restarts, a requeue, or the "
            f"same command again) continues from it" if files else
            "no checkpoint was written yet: a restart starts the run again")
    timeout = f"dist_timeout={run.cfg.dist_timeout:g} s"
    if found is None:
        host, port = peers.where
        line = (f"the rendezvous store at {host}:{port} does not answer: the host that held it (torchrun's "
                f"agent, or rank 0 outside torchrun) is gone; {then}")
    elif found[0]:
        r, why = min(found[0].items())
        line = f"rank {r} stopped: {why}"
    elif found[1]:
        gone = found[1]
        line = (f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} {'are' if len(gone) > 1 else 'is'} "
                f"gone (no answer to a roll call within {ROLL_CALL} s: killed, its node lost, or hung "
                f"past {timeout}); {then}")
    elif "timed out" in str(error).lower() or "timeout" in str(error).lower():
        line = (f"a collective waited past {timeout} with every rank alive: a rank was busy longer than "
                f"that (a checkpoint written alone, a compile); raise --dist_timeout; {then}")
    else:   # every rank is there: this rank's own error (a bug), shown as it is
        signal.signal(signal.SIGTERM, held)
        peers.post(f"{type(error).__name__}: {(str(error) or '?').splitlines()[0]}")
        return None
    return f"rank {run.rank}: {line}"
