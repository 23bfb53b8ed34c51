# Muon beside config/c4_350m.py on the yardstick: the same recipe, with torch.optim.Muon on the layers'
# matrices (AdamW, as there, on the embeddings, head and norms; optimizer = "muon", docs/training.md).
# Moonshot's lr adjustment (match_rms_adamw: each matrix's step scaled to AdamW's RMS, "Muon is Scalable
# for LLM Training", 2025) lets Muon take the recipe's lr (1e-3) and weight decay (0) unchanged, as the
# C4 Muon baselines published with Conda (github.com/jie040109/Conda, benchmark_c4) do. The plan beside
# the AdamW runs': docs/yardstick.md.
import os
exec(open(os.path.join(os.path.dirname(__file__), "c4_350m.py")).read())
out_dir = "out-c4-muon-350m"
optimizer = "muon"
muon_adjust_lr = "match_rms_adamw"
muon_lr = 1e-3
zero1 = True                        # on 8 GPUs each rank orthogonalises its own matrices (plain DDP would run
                                    # every Newton-Schulz on every rank); the same run, bit for bit
