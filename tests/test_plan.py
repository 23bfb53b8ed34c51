"""plan.py --plot: the README's picture of the stages, drawn by the command the README shows, with the
planner's numbers; and the command's one-line refusals."""
import os
import re
import shlex
import sys
from dataclasses import replace

import pytest

import grow
import plan
from data.load import planned_vocab
from model import GPT
from stepgpt import memory
from stepgpt.config import load_config
from stepgpt.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_plot_commands():
    """The README's `python plan.py ... --plot FILE` lines, as arguments, and the picture it shows."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = [m for m in re.findall(r"^python plan\.py .*$", text, re.M) if "--plot" in m]
    (picture,) = re.findall(r"^!\[[^\]]*\]\((docs/[^)]+)\)", text, re.M)
    return [shlex.split(line)[2:] for line in lines], picture


def plotted_rows(argv, tmp_path, capsys):
    """plan.main(argv) in-process with its picture written under tmp_path (not over a committed one):
    the rows it prints, (config, stage or vanilla, stack, model state, step peak)."""
    argv = list(argv)
    argv[argv.index("--plot") + 1] = str(tmp_path / os.path.basename(argv[argv.index("--plot") + 1]))
    plan.main(argv)
    out = capsys.readouterr().out
    with open(argv[argv.index("--plot") + 1], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    row = r"^(\S+)\s+(stage \d+|vanilla)\s+([TF]+)\s+model state\s+([\d,]+)\s+step peak\s+([\d,]+)$"
    return re.findall(row, out, re.M)


def frozen_in_each_stage(tcfg, layers):
    """Which layers each stage trains ("T") and which sit frozen ("F"), bottom to top, as train.py's
    transitions leave them: grow.next_stage on a model of the config's depth, at a tiny width."""
    cfg = replace(grow.model_config(tcfg, layers[0], 64), n_embd=16, n_head=2, ffn_hidden=32, lora_rank=2)
    model, out = GPT(cfg), ["T" * layers[0]]
    for i, n in enumerate(layers[1:], 1):
        grow.next_stage(model, n, tcfg.grow_init, tcfg.grow_where, seed=tcfg.seed + i)
        frozen = set(model.config.frozen_layers)
        out.append("".join("F" if k in frozen else "T" for k in range(model.config.n_layer)))
    return out


def test_the_readmes_stage_picture_is_drawn_from_the_planners_numbers(tmp_path, monkeypatch, capsys):
    """The README's command, in-process, with its picture written under tmp_path (not over the
    committed one): a PNG, and each number it prints as drawn equal to the planner's functions:
    the stages of grow.stage_plan, the model state of grow.stage_memory with memory.state_bytes,
    the step peak of memory.configured_peaks (bf16), vanilla the same final model in one stage."""
    pytest.importorskip("matplotlib", reason="optional: pip install matplotlib")
    (argv, _), picture = readme_plot_commands()
    assert argv[argv.index("--plot") + 1] == picture    # the command draws the picture the README shows
    monkeypatch.chdir(ROOT)
    drawn = plotted_rows(argv, tmp_path, capsys)
    assert not os.path.exists(tmp_path / (os.path.basename(picture) + ".tmp"))
    configs = [a for a in argv if a.endswith(".py")]
    assert configs == ["config/step_small.py", "config/step_350m.py"]
    for config in configs:
        tcfg = load_config([config])
        vocab = planned_vocab(tcfg.data_dir, tcfg.vocab_size)[0]
        layers, _ = grow.stage_plan(tcfg, vocab, tcfg.batch_size * tcfg.block_size)
        final = grow.model_config(tcfg, sum(layers), vocab)
        opt = memory.planned_optimizer(tcfg)
        states = grow.stage_memory(final, layers, memory.state_bytes, train_embeddings=tcfg.train_embeddings,
                                   optimizer=opt) + [memory.state_bytes(final, sum(layers), 0, optimizer=opt)]
        peaks = (memory.configured_peaks(tcfg, final, layers, "bfloat16")
                 + memory.configured_peaks(tcfg, final, [sum(layers)], "bfloat16"))
        stacks = frozen_in_each_stage(tcfg, layers) + ["T" * sum(layers)]
        names = [f"stage {i + 1}" for i in range(len(layers))] + ["vanilla"]
        expected = [(config, n, s, f"{a:,}", f"{b:,}") for n, s, a, b in zip(names, stacks, states, peaks)]
        assert [d for d in drawn if d[0] == config] == expected
    assert len(drawn) == 6 and drawn[4][2].count("F") == 13   # 350M: 13 layers frozen in stage 2


def test_the_readmes_memory_table_is_what_its_two_plan_commands_print(tmp_path, monkeypatch, capsys):
    """Each cell of the README's table "What each stage holds" (the largest STEP stage / vanilla, and
    the share) is computed from the rows the README's two plan.py lines print: the configs as set,
    and with activation checkpointing and the chunked loss."""
    pytest.importorskip("matplotlib", reason="optional: pip install matplotlib")
    (as_set, lean), _ = readme_plot_commands()
    assert "--activation_checkpointing=True" in lean and any(a.startswith("--loss_chunk=") for a in lean)
    monkeypatch.chdir(ROOT)
    rows = {"as set": plotted_rows(as_set, tmp_path, capsys), "lean": plotted_rows(lean, tmp_path, capsys)}
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = re.findall(r"^\| (step_\w+) \([\d.]+M\) \| (.*) \| (.*) \| (.*) \|$", text, re.M)
    assert [name for name, *_ in table] == ["step_small", "step_350m"]

    def cell(pairs):   # the largest STEP stage's bytes and vanilla's -> "a / b UNIT (p %)"
        step, vanilla = max(b for name, b in pairs if name != "vanilla"), dict(pairs)["vanilla"]
        unit, size, digits = ("MiB", 2**20, 1) if vanilla < 2**30 else ("GiB", 2**30, 2)
        return f"{step / size:.{digits}f} / {vanilla / size:.{digits}f} {unit} ({100 * step / vanilla:.0f} %)"

    for name, *cells in table:
        config = f"config/{name}.py"
        state = [(r[1], int(r[3].replace(",", ""))) for r in rows["as set"] if r[0] == config]
        peak, lean_peak = ([(r[1], int(r[4].replace(",", ""))) for r in rows[k] if r[0] == config]
                           for k in ("as set", "lean"))
        assert cells == [cell(state), cell(peak), cell(lean_peak)], name


def test_several_configs_without_plot_print_a_table_each(capsys):
    configs = [os.path.join(ROOT, "config", f"{name}.py") for name in ("step_small", "vanilla_small")]
    plan.main([*configs, "--stages", "2", "--world", "1"])
    heads = [line for line in capsys.readouterr().out.splitlines() if " layers, n_embd " in line]
    assert [h.split(":")[0].rsplit("/", 1)[1] for h in heads] == ["step_small.py", "vanilla_small.py"]


def test_plot_refuses_in_one_line(tmp_path, monkeypatch):
    """A missing matplotlib names the install; table-only options, a missing folder and a format
    matplotlib cannot write are refused before anything is written."""
    config = os.path.join(ROOT, "config", "step_small.py")
    for argv, message in (([f"--plot={tmp_path / 'a.png'}", "--stages", "2"], "leave out --stages"),
                          ([f"--plot={tmp_path / 'none' / 'a.png'}"], "there is no folder"),
                          ([f"--plot={tmp_path / 'a.xyz'}"], "name a .png, .svg or .pdf file")):
        with pytest.raises(UserError, match=message):
            plan.main([config, *argv])
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # makes `import matplotlib` fail
    with pytest.raises(UserError, match="plan.py --plot needs matplotlib: pip install matplotlib"):
        plan.main([config, f"--plot={tmp_path / 'a.png'}"])
    assert os.listdir(tmp_path) == []


def test_the_stack_of_a_stage_with_no_new_layers_is_all_frozen():
    """stage_layers=[2, 0] (ReLoRA's baseline: a warm start, then every layer frozen)."""
    tcfg = load_config(["--stage_layers=[2, 0]", "--n_embd=32", "--n_head=2", "--vocab_size=64"])
    rows = plan.stage_picture(tcfg, grow.model_config(tcfg, 2, 64), 2)
    assert [(name, stack) for name, stack, _, _ in rows] == [("stage 1", "TT"), ("stage 2", "FF"),
                                                              ("vanilla", "TT")]
    assert all(r[2] > 0 and r[3] > r[2] for r in rows)
