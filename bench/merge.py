"""How much of an adapter's update survives one merge into the int8 weight, by update size.

    python bench/merge.py

A 1024 x 1024 Gaussian weight is frozen in int8; its adapter is set so that B·A moves every element
by a random fraction of its row's quantisation step (the sizes in the first column, each element
uniform in +-size). One merge with round-to-nearest and one with stochastic rounding; for each, the
share of the update the new int8 weight carries (its projection on the update: 1 = all of it) and
the rounding error relative to the update. Real runs log the same two numbers at every merge.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from model import FrozenLoRALinear, merge_quality

N = K = 1024


def merge_once(steps, rounding):
    torch.manual_seed(0)
    lin = FrozenLoRALinear.from_weight(torch.randn(N, K), rank=N, alpha=N)   # rank N: any update, scale 1
    with torch.no_grad():
        update = (torch.rand(N, K) * 2 - 1) * steps * lin.weight_scale[:, None]
        lin.lora_b.copy_(torch.eye(N))
        lin.lora_a.copy_(update)
    return merge_quality(lin.merge(rounding, torch.Generator().manual_seed(1)))


def main():
    print(f"{'update (steps)':>15} | {'nearest kept':>12} {'error':>8} | "
          f"{'stochastic kept':>15} {'error':>8}")
    for steps in (0.1, 0.25, 0.5, 1, 2, 5, 20):
        (kn, en), (ks, es) = merge_once(steps, "nearest"), merge_once(steps, "stochastic")
        print(f"{steps:>15} | {100 * kn:11.1f}% {100 * en:7.1f}% | {100 * ks:14.1f}% {100 * es:7.1f}%")


if __name__ == "__main__":
    main()
