"""The BLAKE2b digest of a checkpoint's model tensors (names, dtypes, shapes and bytes), to show that
two runs ended bit-identical.

    python tools/digest.py out-step-small/ckpt-00000586.pt [MORE.pt ...]
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from stepgpt.checkpoint import load_checkpoint, tensor_digest
from stepgpt.errors import UserError, run_cli


def main(argv):
    if not argv:
        raise UserError("give one or more checkpoint files (or run folders, for their newest)")
    for path in argv:
        print(tensor_digest(load_checkpoint(path)["model"]), path)


if __name__ == "__main__":
    run_cli(main)
