# The field's yardstick (GaLore, ICML 2024, Table 2): LLaMA-130M pre-trained on C4, vanilla, as the
# published table was made (GaLore's released configs and scripts): hidden 768, FFN 2048 (SwiGLU),
# 12 heads, 12 layers, RMSNorm eps 1e-6, untied 32,000-row vocabulary (the T5 tokenizer); one C4
# document per row of 256 tokens, padding masked (data prepared with --mode=sequences --seq_len=256);
# 512 rows (131,072 tokens) per step, 20K steps (2.62B tokens), cosine to 0.1 of lr 1e-3 after a 10 %
# warm-up, Adam (betas 0.9, 0.999), no weight decay, no clipping; val perplexity on 10M tokens.
# Data, the targets, the plan and the time: docs/yardstick.md. STEP beside it: config/c4_step_130m.py.
out_dir = "out-c4-130m"
data_dir = "data/c4"
vocab_size = 32000

n_layer = 12
n_embd = 768
n_head = 12
ffn_hidden = 2048
block_size = 256
norm_eps = 1e-6

batch_size = 64
gradient_accumulation_steps = 8     # 512 rows per step, divided over 1 or 8 GPUs
max_iters = 20_000
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 2_000
weight_decay = 0.0
beta2 = 0.999
grad_clip = 0.0

eval_interval = 1_000
eval_tokens = 10_000_000            # the val loss and perplexity on 10M tokens (padding not counted)
eval_iters = 10                     # the train loss's random batches
log_interval = 50
