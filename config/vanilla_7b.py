# The vanilla twin of config/step_7b.py: 32 layers, all trainable, the same tokens, 8-bit AdamW and
# checkpointing as well (with fp32 AdamW its planned step peak, 125.5 GiB, fits no 80 GB GPU).
import os
exec(open(os.path.join(os.path.dirname(__file__), "step_7b.py")).read())
out_dir = "out-vanilla-7b"
stage_layers = [32]
stage_tokens = [sum(stage_tokens)]
