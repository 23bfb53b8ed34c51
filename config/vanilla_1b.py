# The vanilla twin of config/step_1b.py: 24 layers, all trainable, the same tokens.
import os
exec(open(os.path.join(os.path.dirname(__file__), "step_1b.py")).read())
out_dir = "out-vanilla-1b"
target_layers = 0
n_stages = 1
stage_layers = [24]
stage_tokens = [sum(stage_tokens)]
