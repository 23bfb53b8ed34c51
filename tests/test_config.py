"""Config files and overrides (stepgpt/config.py): every key checked once, the STEP stage keys included."""
import dataclasses
import os

import pytest

import grow
from stepgpt.config import TrainConfig, load_config
from stepgpt.errors import UserError
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))


def test_config_file_then_overrides(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("batch_size = 8\nlearning_rate = 3e-4\nstage_layers = [2, 1]\n_private = 1\n")
    cfg = load_config([str(cfg_file), "--batch_size=2", "--learning_rate=1", "--out_dir=a=b",
                       "--grow_where=lower", "--compile=False"])
    assert cfg.batch_size == 2 and cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert cfg.out_dir == "a=b"                        # split on the first '=' only
    assert cfg.stage_layers == [2, 1] and cfg.grow_where == "lower" and cfg.compile is False


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_loads_from_any_working_directory(name, tmp_path, monkeypatch):
    """A config that builds on another (the vanilla twins) finds it next to itself, not in the cwd."""
    monkeypatch.chdir(tmp_path)
    assert load_config([os.path.join(ROOT, "config", name)]).out_dir.startswith("out-")


def test_vanilla_twins_train_the_same_final_model_on_the_same_tokens():
    for size in ("small", "350m", "1b", "7b"):
        step = load_config([os.path.join(ROOT, "config", f"step_{size}.py")])
        vanilla = load_config([os.path.join(ROOT, "config", f"vanilla_{size}.py")])
        assert grow.final_depth(step) == grow.final_depth(vanilla) and grow.stage_count(vanilla) == 1
        assert sum(step.stage_tokens) == sum(vanilla.stage_tokens)
        same = {k for k in ("n_embd", "n_head", "ffn_hidden", "block_size", "batch_size",
                            "gradient_accumulation_steps", "optimizer", "activation_checkpointing",
                            "loss_chunk")}
        assert {k: getattr(step, k) for k in same} == {k: getattr(vanilla, k) for k in same}


def test_every_model_field_can_be_set_from_a_config():
    """Each GPTConfig field a user may choose has a TrainConfig key of the same name, and its value
    reaches the model (rope_theta and norm_eps once did not)."""
    chosen_by_the_run = {"n_layer", "vocab_size", "frozen_layers", "train_embeddings"}   # set per stage
    model_fields = {f.name for f in dataclasses.fields(GPTConfig)} - chosen_by_the_run
    assert model_fields <= {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = load_config(["--rope_theta=500000", "--norm_eps=1e-6", "--n_embd=32", "--n_head=2",
                       "--ffn_hidden=64"])
    mcfg = grow.model_config(cfg, 2, 128)
    assert mcfg.rope_theta == 500000.0 and mcfg.norm_eps == 1e-6 and mcfg.ffn_hidden == 64
    model = GPT(mcfg)
    assert model.norm.eps == 1e-6
    inv_freq_1 = model.rope_sin[1, 1].asin()       # angle of position 1, frequency index 1 = theta^(-2/hs)
    assert abs(inv_freq_1.item() - 500000.0 ** (-2 / 16)) < 1e-6


@pytest.mark.parametrize("argv, message", [
    (["--no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--batch_size=2.5"], "wants a int"),
    (["--compile=1"], "wants a bool"),
    (["--batch_size"], "needs a value"),
    (["missing_config.py"], "not found"),
    (["--batch_size=0"], "batch_size=0 must be >= 1"),
    (["--gradient_accumulation_steps=0"], "must be >= 1"),
    (["--learning_rate=-0.1"], "learning_rate=-0.1 must be a finite number > 0"),
    (["--learning_rate=0"], "learning_rate=0.0 must be a finite number > 0"),
    (["--learning_rate=1e999"], "must be a finite number"),
    (["--min_lr=-1e-5"], "min_lr"),
    (["--min_lr=1e-2", "--learning_rate=1e-3"], "min_lr=0.01 is above learning_rate"),
    (["--weight_decay=-0.1"], "weight_decay"),
    (["--lora_weight_decay=-1"], "lora_weight_decay"),
    (["--beta1=1.0"], "beta1=1.0 must be in [0, 1)"),
    (["--beta2=-0.5"], "beta2"),
    (["--grad_clip=-1"], "grad_clip"),
    (["--warmup_iters=-5"], "warmup_iters"),
    (["--stage_warmup_iters=-1"], "stage_warmup_iters"),
    (["--max_iters=-1"], "max_iters"),
    (["--max_iters=0"], "max_iters must be >= 1"),
    (["--stage_tokens=[1000, 0]"], "stage_tokens"),
    (["--stage_tokens=[1e6]"], "stage_tokens"),
    (["--lora_alpha=0"], "lora_alpha"),
    (["--rope_theta=-1"], "rope_theta"),
    (["--dtype=fp8"], "dtype='fp8': use one of"),
    (["--merge_rounding=up"], "merge_rounding"),
    (["--device=tpu"], "device='tpu': use auto, cpu, cuda, cuda:N or mps"),
    (["--frozen_layers=[0]"], "frozen_layers is set by the stages"),
    (["--n_embd=30", "--n_head=4"], "n_embd=30 must split into n_head=4 heads"),
    (["--init_from=nowhere.pt"], "init_from"),
    (["--dist_timeout=0"], "dist_timeout=0.0 must be a finite number > 0"),
])
def test_bad_value_is_one_clear_error(argv, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(argv)


@pytest.mark.parametrize("argv, message", [
    (["--stage_layers=[0, 2]"], "the first stage needs at least one layer"),
    (["--stage_layers=[2, -1]"], "later ones 0 or more"),
    (["--stage_layers=[2, 2]", "--target_layers=5"], "sum to 4"),
    (["--stage_layers=[2, 2]", "--lora_rank=1000"], "lora_rank"),
    (["--grow_init=magic"], "grow_init"),
    (["--grow_where=sideways"], "grow_where"),
    (["--n_stages=2"], "needs target_layers"),
    (["--target_layers=3", "--n_stages=4"], "n_stages=4"),
    (["--stage_layers=[1, 1]", "--stage_tokens=[1000]"], "stage_tokens has 1 entries for 2 stages"),
])
def test_bad_stage_keys_are_one_clear_error(argv, message):
    with pytest.raises(UserError, match=message):
        load_config(argv)
