"""The machinery beside STEP's learner's path (model.py, frozen_linear.py, grow.py, train.py): the
run's config, the Triton kernels and their dispatch, optimizers beyond AdamW, checkpoints and the
run's infrastructure, and the memory model beyond the paper's Eq. 1-3. See the README's layout."""
