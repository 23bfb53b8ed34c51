"""One process at a time in a folder: a run in its out_dir, data/prepare.py in its output folder."""
import os
import socket
import time

from stepgpt.errors import UserError

try:
    import fcntl
except ImportError:   # Windows: no advisory locks, the folder is not guarded
    fcntl = None


class FolderLock:
    """FOLDER/NAME, held while one process works in the folder, so that a second one (a job launched
    twice, a requeue while the old job still dies, two first runs that both prepare the default data)
    stops at once, or with wait=True waits for the first. flock is released by the OS when the
    process dies: a killed process leaves nothing stuck. Taking it also proves the folder writable.
    `what` names the folder's role in messages ("out_dir='out'"), `fix` what the user can do instead."""

    def __init__(self, folder, name, what, fix, wait=False):
        self.f = None
        try:
            os.makedirs(folder, exist_ok=True)
            f = open(os.path.join(folder, name), "a+")
        except OSError as e:
            raise UserError(f"{what} is not writable ({e.strerror or e}); {fix}") from None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                if not wait:
                    f.close()
                    raise UserError(f"{what} is in use by another process ({holder}); wait for it to end or "
                                    f"stop it, or {fix}") from None
                print(f"waiting for the process that holds {what} ({holder})", flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self.f = f

    def release(self):
        if self.f is not None:
            self.f.close()   # closing the file releases the lock
            self.f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
