"""tools/: the loss plot of runs and the digest of a checkpoint's tensors, as docs/ runs them
(in-process, scaled down to tiny runs)."""
import xml.etree.ElementTree as ET

import pytest

import train
from tests.helpers import write_dataset
from tools import digest, plot_losses

TINY = ["--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2",
        "--lora_rank=4", "--eval_iters=1", "--log_interval=1", "--sample_tokens=0", "--warmup_iters=1",
        "--stage_warmup_iters=1", "--max_iters=6", "--eval_interval=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    data = write_dataset(tmp / "data")
    for name, stages in (("step", "[1, 1]"), ("vanilla", "[2]"), ("again", "[1, 1]")):
        train.main(TINY + [f"--data_dir={data}", f"--out_dir={tmp / name}", f"--stage_layers={stages}"])
    return tmp


def test_plot_losses_draws_an_svg_of_the_runs(runs, capsys):
    pytest.importorskip("matplotlib", reason="optional: pip install matplotlib")
    out = runs / "losses.svg"
    plot_losses.main([str(runs / "step"), str(runs / "vanilla"), "--out", str(out)])
    assert ET.parse(out).getroot().tag.endswith("svg") and f"wrote {out}" in capsys.readouterr().out
    train_, val, growth = plot_losses.load(str(runs / "step"))
    assert len(train_) == 6 and [s for s, _ in val] == [0, 2, 4, 6] and growth == [3]


def test_digest_says_whether_two_runs_ended_bit_identical(runs, capsys):
    digest.main([str(runs / "step"), str(runs / "again"), str(runs / "vanilla")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == lines[1].split()[0] != lines[2].split()[0]
