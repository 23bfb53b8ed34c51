"""The layout the README promises: the learner's path and its size, the style check, and no clash
with the packages our users have installed beside us."""
import ast
import contextlib
import inspect
import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

import train
from stepgpt.config import load_config
from tests.helpers import HANG, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNERS_PATH = ("model.py", "frozen_linear.py", "grow.py", "train.py")


def code_lines(source, node=None):
    """Lines of code of `source` (or of its part `node`, an ast node of it): no blank lines, comments,
    decorators or docstrings."""
    tree = node or ast.parse(textwrap.dedent(source))
    docstrings = set()
    for child in ast.walk(tree):
        body = getattr(child, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = source.splitlines()
    first, last = (node.lineno, node.end_lineno) if node else (1, len(lines))
    return sum(1 for i in range(first, last + 1) if lines[i - 1].strip() and i not in docstrings
               and not lines[i - 1].strip().startswith(("#", "@")))


def functions_of(path, cache={}):   # noqa: B006 (the cache)
    """[(first line incl. decorators, last line, qualified name, code lines)] of a file's functions."""
    if path not in cache:
        text, out = open(path).read(), []

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    out.append((first, child.end_lineno, prefix + child.name, code_lines(text, child)))
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
        visit(ast.parse(text), "")
        cache[path] = out
    return cache[path]


def traced_run(tmp_path):
    """Every function of ours a tiny 3-stage run of config/step_small.py runs, split into those it
    runs inside train.enter_stage and those it runs elsewhere: {(file, name): code lines} twice."""
    data = write_dataset(str(tmp_path / "data"))
    cfg = load_config([os.path.join(ROOT, "config", "step_small.py"), f"--data_dir={data}",
                       f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--n_embd=32", "--n_head=2",
                       "--ffn_hidden=64", "--block_size=16", "--batch_size=2", "--lora_rank=4",
                       "--stage_layers=[2,2,2]", "--stage_tokens=[96,96,96]", "--eval_interval=2",
                       "--eval_iters=1", "--log_interval=1", "--sample_tokens=0"])
    inside, outside, depth = {}, {}, [0]
    boundary = train.enter_stage.__code__

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "return" and code is boundary:
            depth[0] -= 1
        if event != "call":
            return
        depth[0] += code is boundary
        path = code.co_filename or ""
        rel = os.path.relpath(path, ROOT) if path.startswith(ROOT) else ".."
        if not rel.startswith(("..", ".venv", "tests")) and "site-packages" not in rel:
            for first, last, name, n in functions_of(path):
                if first <= code.co_firstlineno <= last:
                    (inside if depth[0] else outside)[(rel, name)] = n
                    break

    with contextlib.redirect_stdout(io.StringIO()):
        sys.setprofile(profile)
        try:
            train.train(cfg)
        finally:
            sys.setprofile(None)
    return inside, outside


def test_the_learners_path_is_short():
    total = sum(len(open(os.path.join(ROOT, f)).read().splitlines()) for f in LEARNERS_PATH)
    # 1,200: what the reading guide was built for; machinery (sharding, the lock, init_from's claim,
    # the ranks' roll call) lives in stepgpt/, the method stays here
    assert total <= 1200, f"{' + '.join(LEARNERS_PATH)} = {total} lines"


def test_a_stage_boundary_is_short_counted_by_what_a_run_runs(tmp_path):
    """What a stage boundary adds to a run, traced, not listed: the loop's boundary branch, and every
    function of ours that runs inside train.enter_stage and nowhere else in the run (at most 156
    lines of code: 150 before FSDP's branch of the transition, issue 33). What it shares with the
    rest of the run (the optimizer's construction, the blocks' constructors, the re-wrap, the replica
    check, the log) is counted apart."""
    inside, outside = traced_run(tmp_path)
    only = {k: n for k, n in inside.items() if k not in outside}
    shared = {k: n for k, n in inside.items() if k in outside}
    lines = inspect.getsource(train.train).splitlines()
    start = next(i for i, line in enumerate(lines) if "# the stage boundary" in line)
    end = next(i for i, line in enumerate(lines) if "elif it in run.restarts" in line)
    branch = code_lines("\n".join(lines[start:end]))
    for must in [("train.py", "enter_stage"), ("grow.py", "next_stage"), ("grow.py", "grow"),
                 ("model.py", "FrozenLoRALinear.merge"), ("model.py", "quantize_int8"),
                 ("model.py", "Block.freeze")]:
        assert must in only, must   # the trace saw the method itself
    report = "\n".join(f"{n:4} {f}:{name}" for (f, name), n in sorted(only.items()))
    assert branch + sum(only.values()) <= 156, report
    assert branch + sum(only.values()) + sum(shared.values()) <= 270, sorted(shared.items())   # 260 pre-FSDP


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_no_module_of_ours_shadows_an_installed_one_or_another_of_ours():
    """Python puts a script's folder first on sys.path (pytest puts tests/ there): no module of ours
    in any folder may take the name of an installed package (Hugging Face's `kernels`, which
    transformers imports), of the standard library, or of another module of ours. The one exception
    is bench/kernels.py, the command docs/kernels.md names: every script below the root puts the root in
    its folder's place on sys.path before it imports anything, so bench/ is never searched."""
    from importlib.metadata import packages_distributions
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                             cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    tracked = sorted(set(tracked))   # an unmerged file is listed once per stage
    ours = {}
    for path in tracked:
        folder, name = os.path.split(path[:-3])
        if name not in ("__init__", "conftest") and not folder.startswith("stepgpt"):   # stepgpt.*: a package
            ours.setdefault(name, []).append(path)
    ours.update({name: [name + "/"] for name in ("data", "stepgpt")})
    installed = set(packages_distributions()) | set(sys.stdlib_module_names)
    clashes = {name: paths for name, paths in ours.items()
               if (name in installed or len(paths) > 1) and paths != ["bench/kernels.py"]}
    assert not clashes, clashes
    # Hugging Face's `kernels` is installed where transformers requires it (5.25.0; not 5.20.2, Python 3.10's)
    from importlib.metadata import PackageNotFoundError, requires
    from packaging.requirements import Requirement
    try:
        needs = [Requirement(r) for r in requires("transformers") or []]
    except PackageNotFoundError:
        needs = []
    assert "kernels" in installed or not [r for r in needs if r.name == "kernels" and r.marker is None]
    top = {name for name, paths in ours.items() if "/" not in paths[0] or paths[0].endswith("/")}
    for path in tracked:   # a script below the root that imports our modules puts the root first
        text = open(os.path.join(ROOT, path)).read()
        if os.path.dirname(path) in ("bench", "downstream", "tools", "data") and "__main__" in text:
            tree = ast.parse(text)
            names = {(n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
                     for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                     for a in n.names}
            if names & (top | {"bench", "downstream", "tools"}):
                assert "sys.path[0] = ROOT" in text, path


@pytest.mark.slow
def test_with_the_root_first_on_the_path_kernels_is_hugging_faces():
    """The root on sys.path (as a script at the root has it): transformers, which imports Hugging
    Face's `kernels`, finds theirs, not stepgpt/kernels."""
    pytest.importorskip("transformers")
    code = ("import kernels, transformers, bitsandbytes; from transformers import LlamaForCausalLM; "
            "assert 'site-packages' in kernels.__file__, kernels.__file__; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_product_cites_no_file_a_clone_lacks():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for name in tracked:
        if name.endswith((".py", ".sh", ".toml", ".txt")) or (name.endswith(".md") and os.path.dirname(name)
                                                                in ("", "docs")):
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                text = f.read()
            assert "shared" + "/" not in text and "kernel" + "_anchors" not in text, name   # not in a clone


def test_the_requirements_leave_triton_to_torchs_own_pin_on_linux_alone():
    """requirements-cuda.txt holds the supported ranges (a machine whose torch is installed, a CUDA
    build from PyTorch's index say, keeps it): triton on Linux only, where PyPI has its wheels, and
    never pinned, which torch's Linux wheels do themselves (3.6.0 for torch 2.11, 3.7.1 for 2.13.0).
    requirements.txt and requirements-test.txt are the stack CI tests: every other package pinned.
    That each resolves from PyPI on every platform and Python is .ci/run's check (uv)."""
    def lines(name):
        with open(os.path.join(ROOT, name)) as f:
            return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    ranges = lines("requirements-cuda.txt")
    assert {"torch>=2.11", 'triton>=3.6; platform_system == "Linux"'} <= set(ranges)
    assert not [line for line in ranges if re.match(r"(torch|triton)\s*==", line)]
    pinned = lines("requirements.txt")
    assert pinned[:2] == ["-r requirements-cuda.txt", "torch==2.13.0"]
    # a torch installed first from PyTorch's own index (docs/install.md: CPU-only, another CUDA) stays
    from packaging.requirements import Requirement
    for build in ("2.13.0+cpu", "2.13.0+cu128"):
        assert all(Requirement(line.split(";")[0]).specifier.contains(build)
                   for line in ranges + pinned if line.startswith("torch")), build
    for line in pinned[1:] + lines("requirements-test.txt"):
        assert re.fullmatch(r"[a-z][\w.-]*==[\w.]+(; python_version [<>]=? \"3\.\d+\")?", line), line
        assert not line.startswith("triton"), line
