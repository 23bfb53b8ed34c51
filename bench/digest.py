"""The BLAKE2b digest of a checkpoint's model tensors (names, dtypes, shapes and bytes), to show that
two runs ended bit-identical.

    python bench/digest.py out-step-small/ckpt-00000586.pt
"""
import hashlib
import sys

import torch

MAGIC_LINE_AND_DIGEST = 23 + 64 + 1   # stepgpt/checkpoint.py's header: the magic line, the digest, "\n"


def model_digest(path):
    with open(path, "rb") as f:
        f.seek(MAGIC_LINE_AND_DIGEST)
        state = torch.load(f, map_location="cpu", weights_only=False)["model"]
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(model_digest(path), path)
