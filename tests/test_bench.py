"""The bench/ scripts run as their docstrings show (the quick ones in full, the long ones scaled down)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv, timeout=300):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_merge_survival_table():
    rows = [line.split("|") for line in run("bench/merge.py").splitlines()[1:]]
    kept = {float(r[0]): (float(r[1].split()[0].rstrip("%")), float(r[2].split()[0].rstrip("%"))) for r in rows}
    assert kept[0.1][0] < 5 and abs(kept[0.1][1] - 100) < 5     # nearest loses a tenth-step update; stochastic keeps it
    assert abs(kept[20][0] - 100) < 1 and abs(kept[20][1] - 100) < 1
