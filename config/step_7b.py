# STEP at LLaMA-7B's shape (hidden 4096, 32 layers, 32 heads, FFN 11008, sequence 2048, untied
# 32,000-token vocabulary: 6.74B parameters) on one 80 GB GPU. Three stages planned by Eq. 3 with
# 8-bit AdamW state (bitsandbytes), activation checkpointing and the chunked loss: the planned bf16
# step peak is 28.5 GiB, where vanilla training of the same model needs 125.5 GiB with fp32 AdamW
# and checkpointing, and 65.4 GiB with 8-bit AdamW and checkpointing too (config/vanilla_7b.py):
#   python plan.py config/step_7b.py
#   python bench/peak_memory.py --meta config/step_7b.py       # the same state, counted on the meta device
# Data: FineWeb-Edu in the 32,000-token vocabulary, 135B tokens (20 per parameter):
#   python data/prepare.py --source=fineweb-edu --max_tokens=135100000000 --vocab_ranks=31999
out_dir = "out-step-7b"
data_dir = "data/fineweb-edu"
vocab_size = 32000

n_embd = 4096
n_head = 32
ffn_hidden = 11008
block_size = 2048
lora_rank = 64
lora_alpha = 128.0

stage_layers = [12, 11, 9]   # Eq. 3 with 8-bit AdamW state: plan.py's "int8 + 8-bit AdamW" K = 3 row
stage_tokens = [45_000_000_000, 45_000_000_000, 45_000_000_000]

optimizer = "adamw8bit"
activation_checkpointing = True
loss_chunk = 2048

batch_size = 4
gradient_accumulation_steps = 64    # 256 sequences = 524,288 tokens per step (divided over ranks)
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
stage_warmup_iters = 200
eval_interval = 1000
eval_iters = 50
log_interval = 10
