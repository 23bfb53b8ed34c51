"""bench/compile_kernels.py: every kernel compiled for sm_90 on this CPU box, as docs/kernels.md runs
it, under this triton and under the lowest supported one (3.6, installed beside it), and a check that
its exit status catches a config that cannot run.

The tests compile the 350M and 1B shapes in bf16, the dtype a GPU run trains in (42 variants,
against 374 for every shape in bf16 and fp16): every kernel with every autotune config, every
launch's shared-memory fit at those shapes, and the main GEMMs' spill and serialisation target,
which is the 350M and 1B bf16 configs' alone; what fp16 and the small and ragged shapes add are
other specialisations of the same configs, which CI compiles in full under both tritons (.ci/run).
Each variant is compiled once per triton: the SASS counts come from the same run as the clean
check."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # subprocesses: python -m pytest -m "not slow" leaves them out

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia", reason="this triton has no CUDA backend")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOWEST = "3.6.0"   # the lowest supported triton: torch 2.11's CUDA wheels pin it
LOWEST_DIR = os.path.join(ROOT, ".cache", f"triton-{LOWEST}")   # git-ignored: a rerun installs nothing
SHAPES = ["--shapes", "350m,1b"]
CLEAN = "0 failed, 0 launches with no config that fits, 0 bf16 main-GEMM configs"


def _run(argv, code=None, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # conftest sets it
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable] + (["-c", code] if code else ["bench/compile_kernels.py"]) + argv
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


def lowest_triton():
    """triton 3.6.0, the GPU machine's, installed from PyPI once into a git-ignored folder to be put
    first on PYTHONPATH (this torch beside it)."""
    if not os.path.isfile(os.path.join(LOWEST_DIR, "triton", "__init__.py")):
        tmp = LOWEST_DIR + ".tmp"   # renamed when complete: a broken install is never taken for one
        subprocess.run(["rm", "-rf", tmp], check=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", tmp,
                              f"triton=={LOWEST}"], capture_output=True, text=True)
        assert pip.returncode == 0, f"could not install triton=={LOWEST} from PyPI: {pip.stderr[-2000:]}"
        os.replace(tmp, LOWEST_DIR)
    return LOWEST_DIR


@pytest.fixture(scope="module")
def compiled():
    """docs/kernels.md's command with --sass, at the 350M and 1B shapes in bf16, under this triton: one
    compile of each variant for the tests below."""
    run = _run([*SHAPES, "--dtypes", "bf16", "--sass"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_every_kernel_compiles_clean_for_sm90(compiled):
    assert f"triton {triton.__version__}," in compiled and CLEAN in compiled
    for kernel in ("_fwd_kernel", "_dx_kernel", "_lora_down_kernel", "_lora_bwd_kernel",
                   "_dequantize_kernel"):
        assert f"| {kernel:<17} | bf16  |" in compiled, kernel


def test_every_kernel_compiles_clean_for_sm90_under_the_lowest_supported_triton():
    """The same check under triton 3.6.0. 3.6 spills in one B3 config, which is therefore not tuned
    there (stepgpt/kernels/frozen_lora.py): 12 B3 configs."""
    run = _run([*SHAPES, "--dtypes", "bf16"], pythonpath=lowest_triton())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"triton {LOWEST}," in run.stdout and CLEAN in run.stdout
    assert sum(line.startswith("| _dx_kernel        | bf16  |") and "1b:attn" in line
               for line in run.stdout.splitlines()) == 12


def test_a_config_over_the_shared_memory_limit_fails_the_check():
    """Six stages of small tiles: over the limit, and quick to compile (256x256x256 tiles took twice
    as long)."""
    code = """if 1:
        import sys, triton
        from bench import compile_kernels
        from stepgpt.kernels import frozen_lora
        huge = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, CONVERT="direct"),
                             num_stages=6, num_warps=4)
        frozen_lora._FWD_CONFIGS[:] = [huge]
        sys.exit(compile_kernels.main(sys.argv[1:]))
    """
    run = _run(["--shapes", "350m", "--dtypes", "bf16", "--kernels", "_fwd_kernel", "--jobs", "1"], code)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "3 launches with no config that fits" in run.stdout and "286,720!" in run.stdout   # attn, up, down
    assert "target missed: _fwd_kernel 64x64x256 direct, 6, 4" in run.stdout


def test_sass_counts_the_main_loops_instructions(compiled):
    """--sass: every forward config's main loop holds its wgmma instructions (HGMMA); the `fp32`
    conversion puts I2F and F2FP in it, the `direct` one none (byte permutes instead)."""
    header = next(line for line in compiled.splitlines() if line.startswith("| kernel | config | MMA"))
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
            for line in compiled.splitlines() if line.startswith("| _fwd_kernel | ")]
    assert len(rows) == 14
    for row in rows:
        assert int(row["MMA"]) > 0, row
        assert (int(row["convert"]) > 0) == (" fp32," in row["config"]), row
        assert (int(row["shuffle"]) > 0) == (" direct," in row["config"]), row
