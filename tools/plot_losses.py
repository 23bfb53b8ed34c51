"""Plot the train and val loss of runs from their metrics.jsonl files (matplotlib; SVG or PNG by the
--out suffix).

    python tools/plot_losses.py out-step-small out-vanilla-small --out bench/step_vs_vanilla_small.svg

Lines: training loss at the log steps; dots: val loss at the evals; dotted verticals: each run's
stage boundaries (growth).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from stepgpt.monitor import read_metrics


def load(run_dir):
    """-> (train [(step, loss)], val [(step, val loss)], the steps where a new stage starts)."""
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[0]
    train = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    # the last record of a stage: a record's step counts the steps done, the growth comes after them
    growth = [a["step"] for a, b in zip(recs, recs[1:])
              if "stage" in a and b.get("stage", a["stage"]) > a["stage"]]
    return train, val, growth


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="out_dir folders holding metrics.jsonl")
    p.add_argument("--out", default="losses.svg")
    p.add_argument("--ymax", type=float, default=0,
                   help="clip the loss axis (default: the largest val loss after step 0)")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: tools/plot_losses.py needs matplotlib: pip install matplotlib")
    for r in a.runs:
        if not os.path.isfile(os.path.join(r, "metrics.jsonl")):
            sys.exit(f"error: {r} has no metrics.jsonl; give the out_dir of a run")
    runs = [(os.path.basename(r.rstrip("/")), *load(r)) for r in a.runs]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for i, (name, train, val, growth) in enumerate(runs):
        c = f"C{i % 10}"
        final = f"{val[-1][1]:.4f}" if val else "-"
        if train:
            ax.plot(*zip(*train), color=c, linewidth=1.2, label=f"{name}: final val {final}")
        if val:
            ax.plot(*zip(*val), "o", color=c, markersize=4)
        for s in growth:
            ax.axvline(s, color=c, linestyle=":", alpha=0.6)
    later = [y for _, _, v, _ in runs for s, y in v if s > 0]
    ys = [y for _, t, v, _ in runs for s, y in t + v if s > 0]
    if ys:   # the early descent is off-scale
        top = a.ymax or max(later or ys)
        ax.set_ylim(min(ys) - 0.05 * (top - min(ys)), top)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
