"""The STEP stage plan and memory table of a config: Eq. 3's stages in the paper's accounting and in
ours (int8 store, 8-bit AdamW, ZeRO-1), each stage's model state and the peak of a training step.

  python plan.py config/step_1b.py [--stages K] [--rank r] [--budget 6e9] [--world 8] [--layers_only]
"""
from stepgpt.errors import run_cli
from stepgpt.memory import main

if __name__ == "__main__":
    run_cli(main)
