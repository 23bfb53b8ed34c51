"""The layout the README promises: the learner's path and its size, the style check, and no clash
with the packages our users have installed beside us."""
import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

import grow
import model
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNERS_PATH = ("model.py", "frozen_linear.py", "grow.py", "train.py")
# what a reader follows to learn what happens at a stage boundary, from the loop down to the int8 store
STAGE_BOUNDARY = [train.enter_stage, train.configure_optimizer, grow.next_stage, grow.grow,
                  grow.insertion_gaps, grow._new_block, grow.carried_parameters, model.GPT.merge_adapters,
                  model.Block.merge_adapters,
                  model.Block.freeze, model.FrozenLoRALinear.from_weight, model.FrozenLoRALinear.store,
                  model.FrozenLoRALinear.stored_weight, model.FrozenLoRALinear.reset_adapter,
                  model.FrozenLoRALinear.adapter_update, model.FrozenLoRALinear.dense_weight,
                  model.FrozenLoRALinear.merge, model.dense_weight, model.quantize_int8, model.round_bf16]


def code_lines(source):
    """Lines of code: no blank lines, comments, decorators or docstrings."""
    source = textwrap.dedent(source)
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith(("#", "@")) and i not in docstrings)


def stage_boundary_in_the_loop():
    """The lines of train.train between the stage-boundary comment and the ReLoRA branch."""
    lines = inspect.getsource(train.train).splitlines()
    start = next(i for i, line in enumerate(lines) if "# the stage boundary" in line)
    end = next(i for i, line in enumerate(lines) if "elif it in run.restarts" in line)
    return "\n".join(lines[start:end])


def learners_path_counts():
    """-> (lines of the learner's path files, of frozen_linear.py, stage-boundary code lines, all lines,
    files)."""
    total = sum(len(open(os.path.join(ROOT, f)).read().splitlines()) for f in LEARNERS_PATH)
    frozen = len(open(os.path.join(ROOT, "frozen_linear.py")).read().splitlines())
    sources = [inspect.getsource(f) for f in STAGE_BOUNDARY] + [stage_boundary_in_the_loop()]
    files = {os.path.basename(inspect.getsourcefile(inspect.unwrap(f)))   # no_grad wraps some
             for f in STAGE_BOUNDARY}
    return (total, frozen, sum(code_lines(s) for s in sources), sum(len(s.splitlines()) for s in sources),
            sorted(files))


def test_the_learners_path_is_short_and_the_readme_says_how_short():
    total, frozen, boundary, boundary_all, files = learners_path_counts()
    assert total <= 1200, f"model.py + frozen_linear.py + grow.py + train.py = {total} lines"
    assert frozen <= 80, f"frozen_linear.py has {frozen} lines"
    assert boundary <= 150 and len(files) <= 3, (boundary, files)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    stated = re.search(r"together (\d[\d,]*) lines.*?frozen_linear\.py.*?(\d+) lines.*?stage boundary.*?"
                       r"(\d+) lines of code \((\d+) with docstrings and comments\)", readme, re.S)
    assert stated, "the README states the learner's path line counts"
    assert [int(g.replace(",", "")) for g in stated.groups()] == [total, frozen, boundary, boundary_all]


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_no_top_level_package_shadows_what_users_install():
    """Hugging Face's `kernels` (a transformers dependency) and friends: none of our top-level names
    may be one of theirs, and transformers and bitsandbytes import from the repository root."""
    ours = {n.removesuffix(".py") for n in os.listdir(ROOT) if n.endswith(".py") or
            os.path.isfile(os.path.join(ROOT, n, "__init__.py"))}
    taken = {"kernels", "transformers", "bitsandbytes", "accelerate", "datasets", "lm_eval", "trl",
             "tokenizers", "safetensors", "huggingface_hub", "peft", "evaluate", "triton", "torch",
             "tiktoken"}
    assert not ours & taken
    pytest.importorskip("transformers")
    code = ("import kernels, transformers, bitsandbytes; from transformers import LlamaForCausalLM; "
            "assert 'site-packages' in kernels.__file__, kernels.__file__; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_product_cites_no_file_a_clone_lacks():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for name in tracked:
        if name.endswith((".py", ".sh", ".toml", ".txt")) or name == "README.md":
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                text = f.read()
            assert "shared" + "/" not in text and "kernel" + "_anchors" not in text, name   # not in a clone
