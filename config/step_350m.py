# STEP at the paper's 368M scale (the ReLoRA/GaLore LLaMA-350M: hidden 1024, 24 layers, FFN 2736,
# 16 heads, sequence 1024, untied 32,000-token vocabulary: 367.97M parameters), for GPUs. Two
# stages planned by grow.plan_stages (Eq. 3) to minimise the peak model-state memory:
#   python plan.py config/step_350m.py
# Data: FineWeb-Edu in a 32,000-token vocabulary (cl100k's first 31,999 BPE ranks + <|endoftext|>),
# 7.3B tokens; needs internet and `pip install datasets`:
#   python data/prepare.py --source=fineweb-edu --max_tokens=7300000000 --vocab_ranks=31999
out_dir = "out-step-350m"
data_dir = "data/fineweb-edu"
vocab_size = 32000

n_embd = 1024
n_head = 16
ffn_hidden = 2736
block_size = 1024
lora_rank = 64
lora_alpha = 128.0

target_layers = 24
n_stages = 2
stage_tokens = [3_600_000_000, 3_600_000_000]   # 7.2B tokens in all, 19.6 per parameter

batch_size = 32
gradient_accumulation_steps = 16    # 512 sequences = 524,288 tokens per step (divided over ranks)
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 1000
stage_warmup_iters = 200
eval_interval = 1000
eval_iters = 50
log_interval = 10
