# STEP at LLaMA-2-70B's width and depth (hidden 8192, 80 layers, 64 heads, FFN 28672, sequence 4096,
# 32,000-token vocabulary) without grouped-query attention (our attention has as many key/value
# heads as query heads): 78.4B parameters, for one node of 8 x 80 GB GPUs with FSDP2 (fsdp = True).
# Four stages by Eq. 3 in the int8 accounting with fp32 AdamW (FSDP divides that state evenly over
# the GPUs): planned per GPU at most 41.9 GiB of model state and a 56.0 GiB bf16 step peak, where
# vanilla training of the same model needs 146 GiB of state per GPU (docs/distributed.md):
#   python plan.py config/step_70b.py --world 8
# Data: FineWeb-Edu in the 32,000-token vocabulary (20 tokens per parameter would be 1.57T):
#   python data/prepare.py --source=fineweb-edu --max_tokens=400000000000 --vocab_ranks=31999
out_dir = "out-step-70b"
data_dir = "data/fineweb-edu"
vocab_size = 32000

n_embd = 8192
n_head = 64
ffn_hidden = 28672
block_size = 4096
lora_rank = 64
lora_alpha = 128.0

stage_layers = [22, 21, 19, 18]
stage_tokens = [100_000_000_000] * 4

fsdp = True
activation_checkpointing = True
loss_chunk = 4096

batch_size = 1
gradient_accumulation_steps = 256   # 256 sequences = 1,048,576 tokens per step (divided over ranks)
learning_rate = 1.5e-4
min_lr = 1.5e-5
warmup_iters = 2000
stage_warmup_iters = 200
eval_interval = 1000
eval_iters = 48                     # a multiple of the world size: FSDP's ranks run every forward together
log_interval = 10
