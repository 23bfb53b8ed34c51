"""A sharded checkpoint (a .dcp folder, which an FSDP run with fsdp_checkpoint=sharded writes, each
rank its rows) as one checkpoint file in this project's format, to share it or to use it on a machine
without the ranks that wrote it:

    python tools/dcp_to_file.py out-step-70b/ckpt-00001000.dcp --out step70b-1000.pt

The folder is verified first (each file's size and BLAKE2b digest against its manifest), then its
tensors are read whole on this process by torch.distributed.checkpoint, as one process resuming
the folder reads it (its metadata through stepgpt/safeload.py's restricted reader: a crafted folder
is refused, nothing in it runs), and the file is written under a
temp name with its digest, fsynced and renamed: a kill or a full disk leaves no half file under
--out. The file holds the same dict as the folder: it resumes, samples, grows and exports as one.
It needs the host memory of the whole model and its AdamW state.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from stepgpt.checkpoint import checkpoint_files, load_checkpoint, new_file, save_checkpoint
from stepgpt.errors import UserError, run_cli


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a .dcp checkpoint folder (or a run folder whose newest is one)")
    parser.add_argument("--out", required=True, type=new_file, help="the file to write (must not exist)")
    args = parser.parse_args(argv)
    folder = args.folder.rstrip("/")
    if os.path.isdir(folder) and not folder.endswith(".dcp"):   # a run folder: its newest
        folder = (checkpoint_files(folder) or [folder])[0]
    if not folder.endswith(".dcp") or not os.path.isdir(folder):
        raise UserError(f"{args.folder} is not a .dcp checkpoint folder (nor a run folder whose newest "
                        f"checkpoint is one): a .pt checkpoint is one file already")
    ckpt = load_checkpoint(folder)   # verified, read whole: the dict a .pt file holds
    save_checkpoint(args.out, ckpt)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:,.1f} MiB): {folder} (step "
          f"{ckpt['iter_num']}) as one file")


if __name__ == "__main__":
    run_cli(main)
