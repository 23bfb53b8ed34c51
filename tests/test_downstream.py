"""The pipeline after pre-training, at tiny size: instruction tuning with TRL (downstream/sft.py),
evaluation with lm-eval on the local tasks (downstream/lm_eval_tasks, downstream/val_docs.py), and the
vanilla-vs-STEP comparison that runs them all (downstream/compare.py). TRL and lm-eval run as the
commands show, in subprocesses started outside the repository; models of 2 layers, width 32, on
text prepared from the tiny instruction set."""
import ast
import json
import os
import re
import shlex
import shutil
import textwrap
import subprocess
import sys

import pytest
import transformers

import train
from downstream import sft
from stepgpt.config import load_config
from stepgpt.errors import UserError
from data.prepare import prepare
from tests.helpers import HANG

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPACA = os.path.join(ROOT, "tests", "data", "alpaca_tiny.json")
TINY = ["--device=cpu", "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=128", "--batch_size=4",
        "--eval_iters=1", "--log_interval=8", "--sample_tokens=0", "--warmup_iters=2",
        "--stage_warmup_iters=1", "--lora_rank=4", "--eval_interval=16", "--learning_rate=1e-2"]
# one thread: the models are tiny, and a second thread only waits on a busy CI machine's other core
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A vanilla and a STEP run of 2 layers on text prepared from the instruction set (2048 BPE
    ranks, so that an Alpaca prompt fits the 128-token context), and the STEP run's export."""
    root = tmp_path_factory.mktemp("downstream")
    os.makedirs(root / "texts")
    with open(ALPACA) as f:
        records = json.load(f)
    for i in range(8):
        text = "".join(f"{r['instruction']} {r['input']}\n{r['output']}\n\n" for r in records[i::8])
        (root / "texts" / f"{i}.txt").write_text(text)
    prepare(str(root / "texts"), str(root / "data"), vocab_ranks=2048, val_fraction=0.25, workers=1)
    for name, stages in (("vanilla", ["--stage_layers=[2]", "--stage_tokens=[8192]"]),
                         ("step", ["--stage_layers=[1,1]", "--stage_tokens=[4096,4096]"])):
        config = os.path.join(ROOT, "config", f"{name}_small.py")
        data, out = f"--data_dir={root / 'data'}", f"--out_dir={root / name}"
        train.train(load_config([config, *TINY, data, out, *stages]))
    run("export_hf.py", str(root / "step"), str(root / "hf-step"), cwd=root)
    return root


def run(script, *args, cwd, ok=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=HANG)
    assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
    return proc


# -- instruction tuning --------------------------------------------------------------------------

def test_prompt_is_masked_from_the_loss(runs, tmp_path):
    """The labels of a batch are the response and <|endoftext|>; the prompt (Alpaca's, with and
    without an Input section) and the padding are -100."""
    with open(ALPACA) as f:
        records = json.load(f)[8:14]
    assert {bool(r["input"]) for r in records} == {True, False}
    trainer, cut = sft.build_trainer(sft.parse_args([str(runs / "hf-step"), ALPACA, "unused"]), records,
                                     str(tmp_path))
    tok = trainer.processing_class
    assert cut == 0 and tok.pad_token == tok.eos_token == "<|endoftext|>"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    for r, ids, labels in zip(records, batch["input_ids"], batch["labels"]):
        text = tok.decode(ids[labels != -100])
        assert text == r["output"] + "<|endoftext|>"
        assert tok.decode(ids).startswith(sft.alpaca_prompt(r["instruction"], r["input"]) + text)


@pytest.mark.parametrize("content, error", [
    (None, "no such file: .*alpaca.json"),
    ("[{\"instruction\": \"a\",", "alpaca.json is not JSON"),
    ("{\"instruction\": \"a\"}", "alpaca.json holds no records"),
    ("[{\"instruction\": \"a\", \"output\": \"b\"}, {\"instruction\": \"a\"}]",
     "record 1 has no string 'output'"),
    ("[{\"instruction\": \"a\", \"input\": 3, \"output\": \"b\"}]", "record 0 has no string 'input'"),
])
def test_sft_bad_data_is_a_one_line_error(runs, tmp_path, monkeypatch, content, error):
    """In-process: sft.py ends with SystemExit's one line, as test_sft_bad_model_folder shows it
    printed by the script."""
    if content is not None:
        (tmp_path / "alpaca.json").write_text(content)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        sft.main([str(runs / "hf-step"), "alpaca.json", "sft"])
    message = str(e.value.code)
    assert message.startswith("error: ") and re.search(error, message), message
    assert "\n" not in message and "Alpaca's format" in message
    assert sorted(os.listdir(tmp_path)) == ([] if content is None else ["alpaca.json"])   # nothing written


def test_sft_bad_model_folder(runs, tmp_path, monkeypatch):
    proc = run("downstream/sft.py", str(runs / "step"), ALPACA, "sft", cwd=tmp_path, ok=False)
    assert proc.stderr == (f"error: {runs / 'step'} has no config.json: give a folder written by "
                           "export_hf.py from a checkpoint with a cl100k tokenizer\n")
    os.makedirs(tmp_path / "sft")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="^error: sft exists: remove it or choose another output folder$"):
        sft.main([str(runs / "hf-step"), ALPACA, "sft"])


# -- the pipeline's commands -----------------------------------------------------------------------

def pipeline_commands():
    """The commands docs/huggingface.md gives for one model (the same as downstream/compare.py's
    docstring), continuation lines joined."""
    readme = open(os.path.join(ROOT, "docs", "huggingface.md")).read()
    block = readme.split("For one model the\nsteps are these commands:")[1]
    block = block.split("```bash\n")[1].split("```")[0]
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "downstream", "compare.py")).read()))
    in_doc = doc.split("The pipeline it runs for each model")[1].split("\n\n")[1]
    assert block.strip() == textwrap.dedent(in_doc).strip(), "the page and compare.py's docstring differ"
    return [shlex.split(line) for line in block.replace("\\\n", "").splitlines()]


@pytest.fixture(scope="module")
def pipeline(runs, tmp_path_factory):
    """The pipeline's commands as the docstring (and docs/huggingface.md) gives them, in a folder laid out as
    the repository with the STEP run under the name used there: -> the folder and what each printed."""
    folder = tmp_path_factory.mktemp("pipeline")
    os.symlink(runs / "step", folder / "out-step-small")
    os.makedirs(folder / "data")
    os.symlink(runs / "data", folder / "data" / "shakespeare")
    for name in ("downstream", "tests"):
        os.symlink(os.path.join(ROOT, name), folder / name)
    commands = pipeline_commands()
    assert [c[0] if c[0] == "python" else c[2] for c in commands] == ["python", "python", "lm_eval", "python",
                                                                       "lm_eval"]
    printed = []
    for cmd in commands:
        if cmd[0] == "python":
            proc = run(cmd[1], *cmd[2:], cwd=folder)
        else:   # VAR=value ... lm_eval ...: the console script, as a user starts it
            env = dict(ENV, **dict(c.split("=", 1) for c in cmd[:2]))
            lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
            proc = subprocess.run([lm_eval, *cmd[3:]], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=HANG)
            assert proc.returncode == 0, proc.stderr[-3000:]
        printed.append(proc.stdout)
    return folder, printed


def test_pipeline_commands(pipeline):
    """Each command runs; lm-eval's bits per byte is ours. The tuned model is a folder transformers
    loads, with Alpaca's prompt as its chat template."""
    tmp_path, printed = pipeline
    ours = float(re.search(r"bits per byte of out-step-small \(ours, lm-eval's windows\): ([\d.]+)",
                           printed[1]).group(1))
    base, tuned = lm_eval_table(printed[2]), lm_eval_table(printed[4])
    assert abs(base["bits_per_byte"] - ours) <= 1e-4 * ours   # lm-eval prints 4 decimals
    assert base.keys() == tuned.keys() >= {"bits_per_byte", "acc", "acc_norm"}
    assert re.search(r"wrote sft-step-small: 132 examples x 3 epochs, 51 steps, loss [\d.]+ -> [\d.]+",
                     printed[3]), printed[3]
    assert not os.path.exists(tmp_path / "sft-step-small.tmp")
    tuned_model = tmp_path / "sft-step-small"
    summary = json.loads((tuned_model / "sft.json").read_text())
    assert summary["steps"] == 51 and summary["max_length"] == 128 and summary["cut"] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned_model)
    tok = transformers.AutoTokenizer.from_pretrained(tuned_model)
    # the chat template it carries is Alpaca's prompt
    messages = [{"role": "user", "content": "Add the two numbers."}, {"role": "input", "content": "3 and 4"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        sft.alpaca_prompt("Add the two numbers.", "3 and 4")
    answered = messages[:1] + [{"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(answered, tokenize=False) == \
        sft.alpaca_prompt("Add the two numbers.") + "7<|endoftext|>"
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1] and tok.pad_token == "<|endoftext|>"


def lm_eval_table(stdout):
    """{metric: value} from the table lm_eval prints."""
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("|") and "---" not in line]
    return {r[5].strip(): float(r[7]) for r in rows[1:]}


# -- the comparison ------------------------------------------------------------------------------

def test_downstream_table_parity_and_rerun(runs, pipeline, tmp_path):
    """downstream/compare.py as its docstring runs it, scaled down (tiny runs, one epoch of tuning):
    a row per model before and after tuning; lm-eval's bits per byte of each pre-trained export
    equals ours on the same documents to 1e-4 (relative); a step whose output is there is skipped.
    The STEP run's export and tuned model are the pipeline's (3 epochs), put where compare.py would
    write them: it takes them and makes the others; a second run redoes nothing."""
    shutil.copytree(pipeline[0] / "hf-step-small", tmp_path / "ds" / "hf-step")
    shutil.copytree(pipeline[0] / "sft-step-small", tmp_path / "ds" / "sft-step")
    argv = ["downstream/compare.py", str(runs / "vanilla"), str(runs / "step"), "--sft_args=--epochs 1",
            f"--out={tmp_path / 'ds'}"]
    first = run(*argv, cwd=tmp_path).stdout
    assert first.count("done before") == 2 and "step: SFT: done before" in first
    results = json.loads((tmp_path / "ds" / "results.json").read_text())
    rows = {r["name"]: r for r in results["rows"]}
    assert list(rows) == ["vanilla", "vanilla + SFT", "step", "step + SFT"]
    assert results["tasks"] == ["step_val", "step_mc"]
    for name, steps in (("vanilla", 17), ("step", 51)):
        theirs = rows[name]["eval"]["step_val"]["bits_per_byte"]
        assert abs(theirs - rows[name]["ours"]) <= 1e-4 * rows[name]["ours"], (name, theirs)
        assert rows[f"{name} + SFT"]["sft"]["steps"] == steps
        for row in (rows[name], rows[f"{name} + SFT"]):
            assert 0 <= row["eval"]["step_mc"]["acc"] <= 1 and 0 <= row["eval"]["step_mc"]["acc_norm"] <= 1
    table = (tmp_path / "ds" / "table.md").read_text().splitlines()
    assert table[0].startswith("| model | val bits/byte, ours | SFT loss") and len(table) == 6
    assert table[2] in first
    assert (tmp_path / "ds" / "downstream.png").read_bytes().startswith(b"\x89PNG")
    again = run(*argv, cwd=tmp_path).stdout
    assert again.count("done before") == 8 and table[5] in again


def test_downstream_errors(runs, tmp_path):
    """The script says why it cannot run; the second case in-process (its UserError is the one line)."""
    from downstream import compare
    proc = run("downstream/compare.py", str(runs / "vanilla"), str(runs / "step"), "--scale", "350m",
               cwd=tmp_path, ok=False)
    assert "--scale 350m needs --sft_data" in proc.stderr
    with pytest.raises(UserError, match="^no checkpoint at"):
        compare.main([str(runs / "vanilla"), str(tmp_path / "none"), f"--out={tmp_path / 'ds'}"])
