# STEP at the paper's 368M scale (ReLoRA/GaLore LLaMA-350M: hidden 1024, 24 layers, FFN 2736,
# 16 heads, sequence 1024), for GPUs. Stages are planned by grow.plan_stages (Eq. 3) to minimise
# the peak model-state memory; `python grow.py plan config/step_350m.py` prints the plan.
# Prepare FineWeb-Edu first: python data/prepare.py --source fineweb-edu --out data/fineweb-edu
out_dir = "out-step-350m"
data_dir = "data/fineweb-edu"

n_embd = 1024
n_head = 16
ffn_hidden = 2736
block_size = 1024
lora_rank = 64
lora_alpha = 128.0

target_layers = 24
n_stages = 2
stage_tokens = [3_600_000_000, 3_600_000_000]   # 7.2B tokens in all, ~20 per parameter

batch_size = 32
gradient_accumulation_steps = 16    # 512 sequences = 524,288 tokens per step (divided over ranks)
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 1000
stage_warmup_iters = 200
eval_interval = 1000
eval_iters = 50
log_interval = 10
