"""Environment defaults for the whole suite. pytest imports this file before any test module, which
matters because Triton reads TRITON_INTERPRET when the kernels are defined, at `import kernels`, and
OpenMP reads OMP_NUM_THREADS when torch is first imported."""
import os

# One thread per process, here and in the scripts the tests start (they inherit it): the tests'
# models are tiny, and a second OpenMP thread only spins, waiting for a core that another process
# holds. On the shared 2-core box a 0.5 s training test took 14 s that way.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU tensors
# model and training tests use the plain-PyTorch kernels; tests/test_kernels.py asks for Triton itself
os.environ.setdefault("STEP_KERNELS", "reference")
