# STEP beside config/c4_130m.py on the yardstick: the same final model (12 layers), data, token
# budget and optimizer, in the paper's stage recipe at this size: K = 2 stages planned by Eq. 3 (the
# layers of each stage chosen to minimise the peak model state; python plan.py config/c4_step_130m.py),
# new layers inserted by interpolation-mean among the upper layers, the earlier layers frozen in int8
# behind rank-64 LoRA adapters, each stage's growth at 75 % of its share of the steps (the paper's
# timing; our reading of it), the learning rate re-warmed at each stage. The plan and the time beside
# the vanilla run's: docs/yardstick.md.
import os
exec(open(os.path.join(os.path.dirname(__file__), "c4_130m.py")).read())
out_dir = "out-c4-step-130m"
target_layers = 12
n_stages = 2
grow_at = 0.75
lora_rank = 64
lora_alpha = 128.0
stage_warmup_iters = 400
