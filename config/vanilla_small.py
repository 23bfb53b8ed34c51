# The vanilla twin of config/step_small.py: the same final 6-layer model on the same tokens, every
# parameter trainable from the start (one stage).
import os
exec(open(os.path.join(os.path.dirname(__file__), "step_small.py")).read())
out_dir = "out-vanilla-small"
stage_layers = [6]
stage_tokens = [sum(stage_tokens)]
