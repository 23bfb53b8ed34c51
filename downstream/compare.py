"""The paper's downstream comparison in one command: a vanilla and a STEP run, each exported to
Hugging Face, instruction-tuned with TRL on the same Alpaca-format data with the same settings,
and evaluated with lm-eval on the same tasks, before and after the tuning; one table and a plot
(matplotlib).

    python downstream/compare.py out-vanilla-small out-step-small             # CPU, a few minutes
    python downstream/compare.py out-vanilla-350m out-step-350m --scale 350m --sft_data alpaca_data.json

The pipeline it runs for each model, as commands of their own (--scale small's paths and settings):

    python export_hf.py out-step-small hf-step-small
    python downstream/val_docs.py data/shakespeare --ckpt out-step-small
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model hf --device cpu --batch_size 16 \\
        --model_args pretrained=hf-step-small,dtype=float32 \\
        --include_path downstream/lm_eval_tasks --tasks step_val,step_mc
    python downstream/sft.py hf-step-small tests/data/alpaca_tiny.json sft-step-small
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model hf --device cpu --batch_size 16 \\
        --model_args pretrained=sft-step-small,dtype=float32 \\
        --include_path downstream/lm_eval_tasks --tasks step_val,step_mc

downstream/lm_eval_tasks holds two local tasks: step_val, bits per byte on the documents of the runs'
validation split (downstream/val_docs.py writes them, and prints our own bits per byte on them: lm-eval
must find the same), and step_mc, 60 multiple-choice questions. --tasks adds lm-eval's own
(arc_easy, hellaswag, ...), which download their data from the Hugging Face Hub. --scale 350m is
the recipe for a GPU: Alpaca's 52k records (alpaca_data.json from
github.com/tatsu-lab/stanford_alpaca), 3 epochs at 2e-5 and 128 sequences a step as Alpaca was
tuned, bf16 autocast, the first 2M validation tokens, and common zero-shot benchmarks. Models are
scored in fp32, by lm-eval and by us alike. Everything goes to --out; a step whose output is there
is skipped when the command runs again (delete it to redo it).
"""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":   # a script: imports resolve in the repository, not in its folder
    sys.path[0] = ROOT
from downstream.val_docs import bits_per_byte, documents
from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import UserError, run_cli
from model import GPT

LOCAL_TASKS = ("step_val", "step_mc")
SCALES = {
    "small": {"sft": [], "sft_data": os.path.join(ROOT, "tests", "data", "alpaca_tiny.json"), "val_tokens": 0,
              "tasks": "step_val,step_mc", "device": "cpu", "batch_size": 16},
    "350m": {"sft": ["--epochs", "3", "--lr", "2e-5", "--batch_size", "16", "--grad_accum", "8"],
             "sft_data": "", "val_tokens": 2_000_000, "device": "cuda", "batch_size": 64,
             "tasks": "step_val,step_mc,arc_easy,arc_challenge,hellaswag,piqa,winogrande"},
}
METRICS = ("bits_per_byte", "acc", "acc_norm")   # what the table shows of each task's results


def step(what, out, cmd, log, env=None, cwd=ROOT):
    """Run one step's command unless its output `out` is there; its log goes to out + '.log'."""
    if os.path.exists(out):
        log(f"{what}: done before ({out})")
        return
    log(f"{what}: {' '.join(cmd)}")
    t0 = time.time()
    with open(out + ".log", "w") as f:
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0 or not os.path.exists(out):
        raise UserError(f"{what} failed (exit {rc}); see {out}.log")
    log(f"{what}: {time.time() - t0:.0f}s")


def lm_eval_results(folder):
    """{task: {metric: value}} from the results file lm_eval wrote under folder."""
    (path,) = glob.glob(os.path.join(folder, "*", "results_*.json"))
    with open(path) as f:
        results = json.load(f)["results"]
    return {task: {m: r[f"{m},none"] for m in METRICS if f"{m},none" in r} for task, r in results.items()}


def table(rows, tasks):
    cols = [(t, m) for t in tasks for m in METRICS if any(m in r["eval"].get(t, {}) for r in rows)]
    out = ["| model | val bits/byte, ours | SFT loss (first -> last) | "
           + " | ".join(f"{t} {m.replace('_', ' ')}" for t, m in cols) + " |", "|---" * (3 + len(cols)) + "|"]
    for r in rows:
        ours = f"{r['ours']:.5f}" if r["ours"] is not None else ""
        sft = f"{r['sft']['first_loss']:.3f} -> {r['sft']['last_loss']:.3f}" if r["sft"] else ""
        vals = [r["eval"].get(t, {}).get(m) for t, m in cols]
        cells = ["" if v is None else f"{v:.4f}" for v in vals]
        out.append(f"| {r['name']} | {ours} | {sft} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows, tasks, path):
    """One panel per task metric, a bar per model (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = [(t, m) for t in tasks for m in METRICS if any(m in r["eval"].get(t, {}) for r in rows)]
    fig, axes = plt.subplots(1, len(cols), figsize=(2.6 * len(cols) + 1, 3.6), squeeze=False)
    names = [r["name"] for r in rows]
    for ax, (t, m) in zip(axes[0], cols):
        vals = [r["eval"].get(t, {}).get(m) or 0 for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=[f"C{j % 10}" for j in range(len(rows))])
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_title(f"{t} {m}", fontsize=9)
        ax.set_xticks([])
    fig.legend(bars, names, loc="lower center", ncol=len(rows), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("vanilla", help="the vanilla run's folder (or checkpoint)")
    p.add_argument("step", help="the STEP run's folder (or checkpoint)")
    p.add_argument("--scale", choices=sorted(SCALES), default="small", help="tuning and evaluation settings")
    p.add_argument("--sft_data", default="", help="Alpaca-format JSON (small: tests/data/alpaca_tiny.json)")
    p.add_argument("--sft_args", default="", help="more sft.py options for both, e.g. '--epochs 1'")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval tasks (default: the scale's)")
    p.add_argument("--data_dir", default="", help="prepared data for step_val (default: the runs' data_dir)")
    p.add_argument("--out", default="out-downstream", help="folder for the exports, tuned models, evals")
    a = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:   # found now, not after an hour of tuning
        raise UserError("downstream/compare.py draws its plot with matplotlib: pip install matplotlib")
    scale = SCALES[a.scale]
    sft_data = os.path.abspath(a.sft_data or scale["sft_data"] or p.error("--scale 350m needs --sft_data"))
    tasks = (a.tasks or scale["tasks"]).split(",")
    runs = {"vanilla": a.vanilla, "step": a.step}
    ckpts = {name: load_checkpoint(path) for name, path in runs.items()}   # before anything is written
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    log = lambda msg: print(f"[downstream {time.strftime('%H:%M:%S')}] {msg}", flush=True)   # noqa: E731
    data_dirs = {ckpt["config"]["data_dir"] for ckpt in ckpts.values()}
    if not a.data_dir and len(data_dirs) > 1:
        raise UserError(f"the runs were trained on different data ({sorted(data_dirs)}); give --data_dir")
    data_dir = a.data_dir or data_dirs.pop()

    # the same validation documents for our scoring and lm-eval's
    enc, docs = documents(data_dir, scale["val_tokens"])
    val_docs = os.path.join(out, "val_docs.jsonl")
    with open(val_docs, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    # lm-eval and TRL run from the output folder with nothing of ours on sys.path (the task files are
    # read by path), offline unless a task must be downloaded
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if set(tasks) <= set(LOCAL_TASKS):
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    lm_eval = [sys.executable, "-m", "lm_eval", "--tasks", ",".join(tasks), "--include_path",
               os.path.join(HERE, "lm_eval_tasks"), "--metadata", json.dumps({"val_docs": val_docs}),
               "--device", scale["device"], "--batch_size", str(scale["batch_size"])]
    rows = []
    for name, path in runs.items():
        hf, sft = os.path.join(out, f"hf-{name}"), os.path.join(out, f"sft-{name}")
        step(f"{name}: export", hf, [sys.executable, os.path.join(ROOT, "export_hf.py"), path, hf], log)
        model = GPT.from_checkpoint(ckpts[name], path).to(scale["device"]).eval()
        ours = bits_per_byte(model, enc, docs)
        log(f"{name}: bits per byte on {len(docs)} validation documents (ours): {ours:.6f}")
        step(f"{name}: SFT", sft, [sys.executable, os.path.join(HERE, "sft.py"), hf, sft_data, sft,
                                   *scale["sft"], *a.sft_args.split()], log, env, out)
        for model_dir, label, score in ((hf, name, ours), (sft, f"{name} + SFT", None)):
            evals = model_dir + "-eval"
            step(f"{label}: lm_eval", evals, lm_eval + ["--model", "hf", "--model_args",
                 f"pretrained={model_dir},dtype=float32", "--output_path", evals], log, env, out)
            summary = None
            if model_dir == sft:
                with open(os.path.join(sft, "sft.json")) as f:
                    summary = json.load(f)
            rows.append({"name": label, "ours": score, "sft": summary, "eval": lm_eval_results(evals)})
    text = table(rows, tasks)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"rows": rows, "tasks": tasks, "scale": a.scale, "data_dir": data_dir,
                   "sft_data": sft_data}, f, indent=1)
    plot(rows, tasks, os.path.join(out, "downstream.png"))
    print(text)
    log(f"wrote {out}/table.md, results.json and downstream.png")


if __name__ == "__main__":
    run_cli(main)
