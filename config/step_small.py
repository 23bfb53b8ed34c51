# STEP on Shakespeare, small enough for a 2-core CPU in a few minutes: a 6-layer model of 5.83M
# parameters (3.17M of them embeddings and head, in the 8,193-token vocabulary data/prepare.py makes).
# Two stages: 3 layers trained fully, then 3 more inserted (interpolation-mean; `upper` puts all
# three above the top old layer, the upper third of 3 gaps: order 0 1 2 n n n) while the first 3
# sit frozen in int8 behind rank-8 LoRA adapters. config/vanilla_small.py trains the same 6-layer
# model on the same tokens, every parameter trainable, for comparison.
out_dir = "out-step-small"
data_dir = "data/shakespeare"

n_embd = 192
n_head = 6
ffn_hidden = 512
block_size = 128
lora_rank = 8
lora_alpha = 16.0

stage_layers = [3, 3]
stage_tokens = [600_000, 600_000]
grow_init = "mean"
grow_where = "upper"

batch_size = 16
# the loss 512 tokens at a time (stepgpt/losses.py): the 2,048 tokens' logits would be 67 MB, new pages
# at every step on a CPU; a fourth of them is faster and leaner (bench/RESULTS.md)
loss_chunk = 512
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 30
stage_warmup_iters = 20
eval_interval = 100
eval_iters = 10
log_interval = 10
