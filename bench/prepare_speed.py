"""Tokens per second of data/prepare.py, end to end (start-up, reading, tokenising, writing, split),
on Shakespeare and on a larger corpus made of Shakespeare's lines shuffled, at 1 and 2 workers.

    python bench/prepare_speed.py                                # ~80 MB corpus, workers 1 and 2
    python bench/prepare_speed.py --mb 20 --workers 1,2,4,8,16   # a smaller corpus, more workers
    # the code before worker processes (it has no --workers flag):
    mkdir -p /tmp/old/data && git show 07112c5:data/prepare.py > /tmp/old/data/prepare.py
    python bench/prepare_speed.py --script /tmp/old/data/prepare.py --workers=-

The corpus is 800 files of shuffled lines (--mb megabytes in all, seeded), written once to --out;
each run is timed as a subprocess and prepares into --out/prepared.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from data.prepare import shakespeare_documents


def make_corpus(folder, mb, files=800, seed=0):
    """--mb megabytes of Shakespeare's lines in random order, as `files` text files."""
    if os.path.isdir(folder):
        return folder
    docs, _ = shakespeare_documents()
    lines = [line for doc in docs for line in doc["text"].splitlines()]
    rng = random.Random(seed)
    per_file = mb * 10**6 // files
    os.makedirs(folder + ".tmp", exist_ok=True)
    for i in range(files):
        text, n = [], 0
        while n < per_file:
            line = rng.choice(lines)
            text.append(line)
            n += len(line) + 1
        with open(os.path.join(folder + ".tmp", f"{i:04d}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n")
    os.replace(folder + ".tmp", folder)
    return folder


def timed(script, source, out, workers):
    cmd = [sys.executable, script, f"--source={source}", f"--out={out}"]
    cmd += [f"--workers={workers}"] if workers != "-" else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    return meta["train_tokens"] + meta["val_tokens"], seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default=os.path.join(ROOT, "data", "prepare.py"), help="prepare.py to time")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts; '-': no --workers flag")
    p.add_argument("--mb", type=int, default=80, help="size of the synthetic corpus in MB")
    p.add_argument("--out", default="out-prepare-speed", help="folder for the corpus and the prepared data")
    p.add_argument("--corpora", default="shakespeare,synthetic", help="which of the two to time")
    a = p.parse_args(argv)
    corpus = make_corpus(os.path.join(a.out, f"corpus-{a.mb}mb"), a.mb)
    print("| corpus | workers | tokens | seconds | tokens/s |\n|---|---|---|---|---|")
    for name, source in (("shakespeare", "shakespeare"), (f"synthetic {a.mb} MB", corpus)):
        if name.split()[0] not in a.corpora.split(","):
            continue
        for workers in a.workers.split(","):
            tokens, seconds = timed(a.script, source, os.path.join(a.out, "prepared"), workers)
            print(f"| {name} | {workers} | {tokens:,} | {seconds:.2f} | {tokens / seconds:,.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
