"""The validation split of a prepared data folder as documents for lm-eval's local task step_val
(downstream/lm_eval_tasks), and our own bits per byte on them, scored the way lm-eval scores a
loglikelihood_rolling task: the check that an exported model computes in lm-eval what it does here.

    python downstream/val_docs.py data/shakespeare                        # -> data/shakespeare/val_docs.jsonl
    python downstream/val_docs.py data/shakespeare --ckpt out-step-small  # ... and our bits per byte on them

The split is cut at each <|endoftext|> (a Hugging Face tokenizer's eos) into documents, decoded to
text (the first may be the tail of a document, where the split fell inside one; a row of
--mode=sequences data is its document's start, padding dropped). --max_tokens keeps the first
documents, up to about that many tokens: a 350M run's validation split holds 0.7B.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import run_cli
from data.load import read_meta, tokenizer_of
from model import GPT


def documents(data_dir, max_tokens=0):
    """-> (the tokenizer of a prepared folder, the documents of its validation split as text)."""
    meta = read_meta(data_dir)
    enc = tokenizer_of(meta, data_dir)
    tokens = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"])
    if "pad_token" in meta:   # one document per row (--mode=sequences): its padding is no text
        tokens = tokens[tokens != meta["pad_token"]]
    docs, start = [], 0
    for end in np.flatnonzero(tokens == meta["eot_token"]):
        if end > start:
            docs.append(enc.decode(tokens[start:end].tolist()))
        start = end + 1
        if max_tokens and start >= max_tokens:
            break
    return enc, docs


def rolling_windows(n, size):
    """(end, predicted) of each window that scores a document of n tokens, as lm-eval's
    get_rolling_token_windows (context_len=1) cuts it: the first window predicts the first `size`
    tokens after the prefix token, each later one the next `size` (fewer at the end), seeing the
    `size` tokens before its last one."""
    end = min(size, n)
    windows = [(end, end)]
    while end < n:
        predicted = min(n - end, size)
        end += predicted
        windows.append((end, predicted))
    return windows


@torch.no_grad()
def bits_per_byte(model, enc, texts, batch_size=16):
    """Our model's bits per UTF-8 byte on texts: the summed negative log-likelihood of each text's
    tokens after <|endoftext|>, in lm-eval's windows of block_size tokens, in bits, over the bytes."""
    size, device = model.config.block_size, next(model.parameters()).device
    windows = []   # (input ids, the ids its last positions predict)
    for text in texts:
        seq = [enc.eot_token] + enc.encode(text, allowed_special="all")   # as the exported tokenizer reads it
        windows += [(seq[max(0, end - size):end], seq[end - n + 1:end + 1])
                    for end, n in rolling_windows(len(seq) - 1, size)]
    nll = 0.0
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        x = torch.zeros(len(batch), max(len(inp) for inp, _ in batch), dtype=torch.long)
        for row, (inp, _) in enumerate(batch):
            x[row, :len(inp)] = torch.tensor(inp)   # padded on the right, which causal attention never sees
        logits, _ = model(x.to(device), x.to(device))
        for row, (inp, target) in enumerate(batch):
            logp = torch.log_softmax(logits[row, len(inp) - len(target):len(inp)].float(), dim=-1)
            nll -= logp.gather(1, torch.tensor(target, device=device)[:, None]).sum().item()
    return nll / math.log(2) / sum(len(text.encode("utf-8")) for text in texts)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_dir", help="a folder data/prepare.py wrote")
    p.add_argument("--out", default="", help="the JSON lines file (default: DATA_DIR/val_docs.jsonl)")
    p.add_argument("--max_tokens", type=int, default=0, help="the first documents up to this many tokens")
    p.add_argument("--ckpt", default="", help="a checkpoint or run folder: print its bits per byte on them")
    a = p.parse_args(argv)
    model = GPT.from_checkpoint(load_checkpoint(a.ckpt), a.ckpt).eval() if a.ckpt else None   # read first
    enc, docs = documents(a.data_dir, a.max_tokens)
    out = a.out or os.path.join(a.data_dir, "val_docs.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    print(f"wrote {out}: {len(docs)} documents, {sum(len(d.encode('utf-8')) for d in docs):,} bytes")
    if model is not None:
        print(f"bits per byte of {a.ckpt} (ours, lm-eval's windows): {bits_per_byte(model, enc, docs):.6f}")


if __name__ == "__main__":
    run_cli(main)
