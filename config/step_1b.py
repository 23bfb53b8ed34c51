# STEP at the paper's 1.2B scale (the ReLoRA/GaLore LLaMA-1B: hidden 2048, 24 layers, 32 heads,
# sequence 1024, untied 32,000-token vocabulary), for GPUs. One deviation: FFN 5504, not 5461
# (8/3 x 2048, rounded up to a multiple of 64). With 5461 every MLP row is misaligned, so the
# kernels' loads and stores go scalar and the K-loop loses its asynchronous copies
# (bench/compile_kernels.py shows both); 5504 costs 0.5 % more parameters: 1.345B, 1.214B in layers.
# Three stages planned by Eq. 3: python plan.py config/step_1b.py
# Data: as config/step_350m.py, with 24B tokens:
#   python data/prepare.py --source=fineweb-edu --max_tokens=24100000000 --vocab_ranks=31999
out_dir = "out-step-1b"
data_dir = "data/fineweb-edu"
vocab_size = 32000

n_embd = 2048
n_head = 32
ffn_hidden = 5504     # the paper's 5461 rounded up to 64 (see above)
block_size = 1024
lora_rank = 64
lora_alpha = 128.0

target_layers = 24
n_stages = 3
stage_tokens = [8_000_000_000, 8_000_000_000, 8_000_000_000]   # 24B tokens, 17.9 per parameter

# micro-batch 8: the planned bf16 step peak (plan.py) is 31.2 GiB, vanilla's 41.0 GiB, far inside an
# 80 GB GPU even where the plan is short (it is derived, not yet measured on a GPU)
batch_size = 8
gradient_accumulation_steps = 64    # 512 sequences per step
learning_rate = 5e-4
min_lr = 5e-5
warmup_iters = 2000
stage_warmup_iters = 200
eval_interval = 1000
eval_iters = 50
log_interval = 10
