# The vanilla twin of config/step_350m.py: 24 layers, all trainable, the same tokens.
import os
exec(open(os.path.join(os.path.dirname(__file__), "step_350m.py")).read())
out_dir = "out-vanilla-350m"
target_layers = 0
n_stages = 1
stage_layers = [24]
stage_tokens = [sum(stage_tokens)]
