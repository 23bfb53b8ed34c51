"""Plot train/val loss of runs from their metrics.jsonl files as one SVG (no plotting dependency).

    python bench/plot_losses.py out-step-small out-vanilla-small --out bench/step_vs_vanilla_small.svg

Solid lines: training loss at the log steps; dots: val loss at the evals; dashed verticals: the
stage boundaries (growth) of each run.
"""
import argparse
import json
import os

W, H, PAD = 720, 420, 56
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def load(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    train = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    growth = [b["step"] for a, b in zip(recs, recs[1:])
              if "stage" in a and b.get("stage", a["stage"]) > a["stage"]]
    return train, val, growth


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="out_dir folders holding metrics.jsonl")
    p.add_argument("--out", default="losses.svg")
    p.add_argument("--ymax", type=float, default=0,
                   help="clip the loss axis (default: the largest val loss after step 0)")
    a = p.parse_args()
    runs = [(os.path.basename(r.rstrip("/")), *load(r)) for r in a.runs]
    xmax = max(s for _, t, v, _ in runs for s, _ in t + v)
    ys = [y for _, t, v, _ in runs for s, y in t + v if s > 0]
    ymin, ymax = min(ys), a.ymax or max(y for _, _, v, _ in runs for s, y in v if s > 0)
    ymin -= 0.05 * (ymax - ymin)
    X = lambda s: PAD + (W - 2 * PAD) * s / xmax                                  # noqa: E731
    Y = lambda y: H - PAD - (H - 2 * PAD) * (y - ymin) / (ymax - ymin)  # noqa: E731
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 16}" text-anchor="middle">iteration</text>',
           f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">loss</text>']
    for k in range(5):
        y = ymin + (ymax - ymin) * k / 4
        s = xmax * k / 4
        svg.append(f'<text x="{PAD - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        svg.append(f'<text x="{X(s):.1f}" y="{H - PAD + 16}" text-anchor="middle">{s:.0f}</text>')
    for i, (name, train, val, growth) in enumerate(runs):
        c = COLORS[i % len(COLORS)]
        # the early descent is off-scale
        pts = " ".join(f"{X(s):.1f},{Y(y):.1f}" for s, y in train if y <= ymax)
        svg.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        svg += [f'<circle cx="{X(s):.1f}" cy="{Y(y):.1f}" r="3.5" fill="{c}"/>'
                for s, y in val if 0 < s and y <= ymax]
        svg += [f'<line x1="{X(s):.1f}" y1="{PAD}" x2="{X(s):.1f}" y2="{H - PAD}" '
                f'stroke="{c}" stroke-dasharray="4 4"/>'
                for s in growth]
        final = f"{val[-1][1]:.4f}" if val else "-"
        svg.append(f'<text x="{W - PAD - 220}" y="{PAD + 18 * i}" fill="{c}">'
                   f'{name}: final val {final}</text>')
    svg.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(svg))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
