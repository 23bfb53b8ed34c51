"""Sample text from a checkpoint.

  python sample.py --ckpt out-step-small --prompt "ROMEO:" --max_new_tokens 300 --temperature 0.8 \
      --top_k 200 --seed 1
"""
import argparse

import torch

from data.load import tokenizer_of
from model import GPT
from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import UserError, run_cli
from stepgpt.runtime import pick_device


def sample_text(model, meta, prompt, max_new_tokens, temperature=0.8, top_k=200, seed=0, num_samples=1,
                data_dir=None):
    """`meta`: the data's (a checkpoint keeps it); `data_dir`: its folder, whose tiktoken.json is the
    tokenizer where it has one (data.load.tokenizer_of)."""
    enc = tokenizer_of(meta, data_dir)
    device = next(model.parameters()).device
    ids = enc.encode_ordinary(prompt) or [meta["eot_token"]]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=g)
    model.train(was_training)
    # ids past the data's vocabulary (the model's vocab is padded to a multiple of 64) and padding
    # (data of one document per row) decode to nothing
    skip = {meta["eot_token"], meta.get("pad_token")}
    texts = [enc.decode([t for t in row if t < meta["vocab_size"] and t not in skip]) for row in out.tolist()]
    return "\n---------------\n".join(texts)


def main(argv):
    p = argparse.ArgumentParser(description="sample text from a checkpoint")
    p.add_argument("--ckpt", default="out-step-small",
                   help="a checkpoint file, or a run folder for its newest")
    p.add_argument("--prompt", default="\n", help="text, or FILE:path to read it from a file")
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = no top-k filter")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (CUDA, then Apple's MPS, then the CPU), cpu, cuda, "
                   "cuda:N or mps")
    a = p.parse_args(argv)
    for key in ("max_new_tokens", "num_samples"):
        if getattr(a, key) < 1:
            raise UserError(f"--{key} {getattr(a, key)} must be >= 1")
    if not 0 <= a.temperature < float("inf") or a.top_k < 0:
        raise UserError(f"--temperature {a.temperature} must be >= 0 (0: greedy) and --top_k {a.top_k} >= 0 "
                        f"(0: no filter)")
    device = pick_device(a.device, 0, ddp=False)
    prompt = a.prompt
    if prompt.startswith("FILE:"):
        try:
            with open(prompt[5:]) as f:
                prompt = f.read()
        except OSError as e:
            raise UserError(f"--prompt {a.prompt}: cannot read {prompt[5:]} ({e.strerror or e})") from None
    ckpt = load_checkpoint(a.ckpt)
    if not ckpt.get("meta"):
        raise UserError(f"{a.ckpt} records no tokenizer (meta); it was not written by train.py")
    model = GPT.from_checkpoint(ckpt, a.ckpt).to(device)
    print(sample_text(model, ckpt["meta"], prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed,
                      a.num_samples, ckpt.get("config", {}).get("data_dir")))   # the run's data folder


if __name__ == "__main__":
    run_cli(main)
