# STEP with Muon beside config/c4_step_350m.py on the yardstick: its stages, with torch.optim.Muon on the
# new layers' matrices and AdamW on the embeddings, head, norms and adapters, at Moonshot's lr adjustment
# and the recipe's lr and weight decay, as config/c4_muon_350m.py. The plan: docs/yardstick.md.
import os
exec(open(os.path.join(os.path.dirname(__file__), "c4_step_350m.py")).read())
out_dir = "out-c4-step-muon-350m"
optimizer = "muon"
muon_adjust_lr = "match_rms_adamw"
muon_lr = 1e-3
zero1 = True                        # on 8 GPUs each rank orthogonalises its own matrices (plain DDP would run
                                    # every Newton-Schulz on every rank); the same run, bit for bit
