"""The README and docs/: every shell command they show is run by a test, every docs/ page is linked
from the README, and every relative link resolves. Text only: no command runs here."""
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# The set-up steps of the README's two commands (split at &&): CI (.ci/run) makes a fresh venv and
# installs from the same requirement files before it runs the test command.
SET_UP = {"python -m venv .venv", ". .venv/bin/activate", "pip install -r requirements.txt",
          "pip install -r requirements.txt -r requirements-test.txt"}

# Commands a named test runs in another form than the page's line (in-process, through a script that
# runs it, or checked where it cannot run here); each: the command as shown -> "tests/FILE.py::TEST: how".
OTHER_FORM = {
    "python train.py config/step_small.py":
        "tests/test_bench.py::test_gpu_check_as_two_offline_jobs_then_a_batch_job: gpu_check.sh's train "
        "step runs it (SMOKE=1: scaled down in size)",
    "python train.py config/vanilla_small.py":
        "tests/test_ddp.py::test_shipped_config_accumulation_pattern_on_two_ranks: every shipped config, "
        "scaled down, on two ranks",
    "python sample.py --ckpt out-step-small --prompt \"ROMEO:\" --max_new_tokens 200 --temperature 0.8 "
    "--top_k 200 --seed 1":
        "tests/test_train.py::test_sample_grow_and_plan_clis: sample.py on a run folder, fewer tokens",
    "python grow.py out-step-small --add 2 --init mean --where upper --out grown.pt":
        "tests/test_train.py::test_sample_grow_and_plan_clis: grow.py on a run folder, then trained from",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128":
        "tests/test_style.py::test_the_requirements_leave_triton_to_torchs_own_pin_on_linux_alone: the "
        "CUDA wheels' triton pins it relies on (the install needs the CUDA index)",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "tests/test_style.py::test_the_requirements_leave_triton_to_torchs_own_pin_on_linux_alone: that "
        "requirements.txt keeps a 2.13.0+cpu torch (the install needs PyTorch's index: CI cannot reach it)",
    "pip install -r requirements-cuda.txt":
        "tests/test_style.py::test_the_requirements_leave_triton_to_torchs_own_pin_on_linux_alone: the "
        "file's ranges against those pins",
}


def bash_commands(page):
    """The command lines of a page's ```bash blocks: continuation lines joined, comments dropped."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(re.sub(r"(^|\s)#\s.*$", "", line).split())
            if line:
                out.append(line)
    return out


def sources_of_tests():
    """{test file: its text} of every test module but this one."""
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read()
            for p in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))) if not p.endswith("test_docs.py")}


def distinctive_words(command):
    """(script, words) a test that runs `command` must name: the script (or program) and its --flags
    without their values (tests scale sizes down; `--key=value` and `--key value` both give `--key`),
    and the environment variables it sets."""
    words = shlex.split(command)
    env = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        env.append(words.pop(0).split("=")[0])
    if words[0] in ("python", "python3", "bash"):
        words = words[1:]
    script = next((w for w in words if w.endswith((".py", ".sh"))), words[0])
    return script, [w.split("=")[0] for w in words if w.startswith("--")] + env


def names_script(text, script):
    """Whether a test names the script: its path (also as a regular expression) or, for a Python
    script it runs in-process, `module.main(`."""
    module = os.path.splitext(os.path.basename(script))[0]
    return script in text or re.escape(script) in text or f"{module}.main(" in text


def run_by(command, page, sources):
    """The test files that run `command`: those holding its text, those that read `page` (by name,
    or every docs/ page) and name its script, and those that name its script and all its flags."""
    flat = " ".join(command.split())
    script, words = distinctive_words(command)
    reads = (os.path.basename(page), '"docs", "*.md"' if page.startswith("docs/") else page)
    return [f for f, text in sources.items()
            if flat in " ".join(text.split())
            or names_script(text, script) and (all(w in text for w in words)
                                               or any(r in text for r in reads))]


def is_suite(command):
    """A run of the test suite itself (pytest, maybe with a marker expression and environment)."""
    return re.match(r"([A-Z_]+=\S* )*python -m pytest( |$)", command) is not None


def test_every_shown_command_is_run_by_a_test():
    sources = sources_of_tests()
    shown = {(page, part.strip()) for page in PAGES for c in bash_commands(page) for part in c.split("&&")}
    assert len(shown) > 40 and any(page.startswith("docs/") for page, _ in shown)
    missing = [f"{page}: {c}" for page, c in sorted(shown) if c not in SET_UP and c not in OTHER_FORM
               and not is_suite(c) and not run_by(c, page, sources)]
    assert not missing, "commands no test runs (run one, or name it in OTHER_FORM):\n" + "\n".join(missing)


def test_the_set_up_steps_are_cis_and_the_suites_markers_exist():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "python -m venv" in ci and "-r requirements.txt -r requirements-test.txt" in ci
    suite = [p.strip() for c in bash_commands("README.md") for p in c.split("&&") if is_suite(p.strip())]
    assert len(suite) == 1 and f"\n{suite[0]}\n" in ci, "CI runs another test command than the README's"
    declared = re.findall(r"^    (\w+):", open(os.path.join(ROOT, "pytest.ini")).read(), re.M)
    for page in PAGES:
        for command in filter(is_suite, (p.strip() for c in bash_commands(page) for p in c.split("&&"))):
            expression = re.search(r' -m "([^"]*)"', command)
            used = re.findall(r"\w+", expression.group(1)) if expression else []
            assert set(used) - {"not", "and", "or"} <= set(declared), (page, command)


def test_the_other_form_list_names_tests_that_exist_and_commands_that_are_shown():
    sources = sources_of_tests()
    shown = {c for page in PAGES for c in bash_commands(page)}
    for command, how in OTHER_FORM.items():
        assert command in shown, f"no page shows {command!r} any more: remove it from OTHER_FORM"
        path, test = how.split(": ")[0].split("::")
        assert re.search(rf"^def {test}\(", sources[path], re.M), f"{how}: no such test"


def test_every_docs_page_is_linked_from_the_readme():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    linked = {os.path.normpath(target.split("#")[0]) for target in re.findall(r"\]\(([^)\s]+)\)", readme)}
    assert [p for p in PAGES[1:] if p not in linked] == []


def prose(page):
    """A page's text without its code blocks."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page):
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", prose(page), re.M)}


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        text = prose(page)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue   # a web address
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, path)):
                bad.append(f"{page}: {target} (no {path})")
            elif anchor and path.endswith(".md") and anchor not in anchors(path):
                bad.append(f"{page}: {target} (no heading #{anchor} in {path})")
    assert bad == []


LEARNERS_PATH = {"model.py", "frozen_linear.py", "grow.py", "train.py"}   # the reading guide's files


def module_table():
    """The README's table of modules: {path: description}, from the code block after "The machinery"."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"^The machinery lives beside it.*?^```\n(.*?)^```", text, re.S | re.M).group(1)
    rows = {}
    for line in block.splitlines():
        if line.strip():
            path, _, words = line.partition(" ")
            if path:
                rows[path] = words.strip()
            else:
                rows[list(rows)[-1]] += " " + line.strip()
    return rows


def test_the_readmes_module_table_lists_every_module_and_names_what_each_holds():
    """Every module beside the learner's path is in the table (itself or its folder), every path
    the table names exists, and each name a row puts in backticks is defined in that row's file (or a
    file of that folder): a description moved to the wrong module, or a module added without a row,
    fails here."""
    import ast
    rows = module_table()
    tracked = [p for p in sorted(glob.glob("**/*.py", root_dir=ROOT, recursive=True))
               if not p.startswith((".", "tests/", "config/")) and "/." not in p]
    folders = tuple(r for r in rows if r.endswith("/"))
    unlisted = [p for p in tracked if p not in LEARNERS_PATH | set(rows) and not p.endswith("__init__.py")
                and not p.startswith(folders)]
    assert unlisted == [], "modules missing from the README's table of modules"
    assert [p for p in rows if not os.path.exists(os.path.join(ROOT, p))] == []
    for path, words in rows.items():
        files = ([os.path.join(ROOT, path)] if path.endswith(".py")
                 else glob.glob(os.path.join(ROOT, path, "**", "*.py"), recursive=True))
        defined = {os.path.basename(f) for f in files}
        for f in files:
            for node in ast.walk(ast.parse(open(f, encoding="utf-8").read())):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    defined.add(node.name)
        named = [n for n in re.findall(r"`([^`]+)`", words) if re.fullmatch(r"[\w.]+", n)]
        assert set(named) <= defined, f"{path}: the README names {set(named) - defined}, not defined there"
        if path.startswith("stepgpt/"):
            assert named, f"{path}: its row names none of what it holds"


def definition_lines(path):
    """{name: line} of a file's functions, classes, their methods and class attributes
    (`Class.name`)."""
    import ast
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    lines = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            lines[node.name] = node.lineno
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AnnAssign, ast.Assign)):
                    name = item.name if isinstance(item, ast.FunctionDef) else (
                        item.target if isinstance(item, ast.AnnAssign) else item.targets[0]).id
                    lines[f"{node.name}.{name}"] = item.lineno
    return lines


def test_the_reading_guide_names_what_each_file_defines_in_the_files_order():
    """Each numbered item of the README's reading guide opens with the names it explains; each is
    defined in the file of its heading, and a file's items follow the file from top to bottom."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    guide = text[text.index("## Read the code"):text.index("The machinery lives beside it")]
    order, path = [], None
    for line in guide.splitlines():
        heading = re.match(r"\*\*([\w/]+\.py)\*\*", line)
        item = re.match(r"(\d+)\. (`[^:]*):", line)
        if heading:
            path, lines, last = heading.group(1), definition_lines(heading.group(1)), 0
        elif item:
            order.append(int(item.group(1)))
            names = re.findall(r"`([\w.]+)`", item.group(2))
            assert names and all(n in lines for n in names), f"{path}: {names} are not all defined there"
            assert lines[names[0]] > last, f"{path}: item {item.group(1)} comes before the one above it"
            last = lines[names[0]]
    assert order == list(range(1, len(order) + 1)) and len(order) >= 18
