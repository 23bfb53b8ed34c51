"""Hugging Face LLaMA folders read back as the first stage of a run (train.py's init_from="hf:PATH"),
and the tensor names both directions share (export_hf.py writes the folders)."""
import importlib
import json
import os

import torch

from model import GPT, LINEARS
from stepgpt.errors import UserError

# names inside a layer: ours -> LlamaForCausalLM's (model.layers.<i>.<name>.weight)
LAYER_NAMES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "attn.o": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
               "mlp.down": "mlp.down_proj"}
assert set(LINEARS) < set(LAYER_NAMES)


def require(module):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"Hugging Face folders need the {module.split('.')[0]} package: "
                        f"pip install -r requirements-test.txt") from None


def name_map(n_layer, tied):
    """-> {HF tensor name: our module path}; each module's .weight is the tensor."""
    names = {"model.embed_tokens.weight": "wte", "model.norm.weight": "norm"}
    if not tied:   # HF ties the head to the embeddings itself (tie_word_embeddings)
        names["lm_head.weight"] = "lm_head"
    for i in range(n_layer):
        names.update({f"model.layers.{i}.{hf}.weight": f"layers.{i}.{ours}"
                      for ours, hf in LAYER_NAMES.items()})
    return names


# the config.json fields config_mismatch reads without a LlamaConfig default
CONFIG_INTS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")


def read_json(path, name):
    """A JSON object file of the HF folder `path`; anything else is one line."""
    try:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:   # unreadable, not UTF-8, not JSON
        why = getattr(e, "strerror", None) or e
        raise UserError(f"hf:{path}: its {name} cannot be read as JSON ({why}); the folder is damaged: "
                        f"export it again") from None
    if not isinstance(obj, dict):
        raise UserError(f"hf:{path}: its {name} holds a JSON {type(obj).__name__}, not an object; the folder "
                        f"is damaged: export it again")
    return obj


def read_hf(path):
    """-> (config.json as a dict, {name: tensor}) of a HF folder: model.safetensors, or the shards
    model.safetensors.index.json lists."""
    load_file = require("safetensors.torch").load_file
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"hf:{path} is not a Hugging Face model folder (no config.json)")
    config = read_json(path, "config.json")
    bad = next((k for k in CONFIG_INTS if type(config.get(k)) is not int), None)
    if bad:
        what = f"{bad}={config[bad]!r}, not an integer" if bad in config else f"no {bad}"
        raise UserError(f"hf:{path}: its config.json has {what}; the folder is damaged: export it again")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(path, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"hf:{path}: its model.safetensors.index.json has no weight_map of tensor names "
                            f"to files; the folder is damaged: export it again")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"hf:{path} has no model.safetensors (a pytorch_model.bin folder: load it in "
                        f"transformers and save_pretrained it with safe_serialization=True)")
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(os.path.join(path, name)))
        except Exception as e:   # safetensors raises its own error types for damaged files
            raise UserError(f"hf:{path}: cannot read {name} ({type(e).__name__}: {e})") from None
    return config, tensors


def config_mismatch(hf, cfg, layers_key):
    """The first field of a HF config that our GPTConfig `cfg` does not match, as an error
    sentence, or None. LlamaConfig's defaults fill fields the file leaves out."""
    heads = hf.get("num_attention_heads")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {"rope_type": rope}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    unsupported = [("model_type", hf.get("model_type"), "llama"),
                   ("num_key_value_heads", hf.get("num_key_value_heads", heads), heads),   # no GQA here
                   ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
                   ("attention_bias", hf.get("attention_bias", False), False),
                   ("mlp_bias", hf.get("mlp_bias", False), False),
                   ("rope type", rope.get("rope_type", rope.get("type", "default")), "default")]
    for key, theirs, ours in unsupported:
        if theirs != ours:
            return (f"its {key}={theirs!r}, but this code builds only {key}={ours!r} (a LLaMA without GQA, "
                    f"biases or RoPE scaling)")
    fitting = [("hidden_size", hf.get("hidden_size"), "n_embd", cfg.n_embd),
               ("num_attention_heads", heads, "n_head", cfg.n_head),
               ("head_dim", hf.get("head_dim", (hf.get("hidden_size") or 0) // (heads or 1)), "n_embd/n_head",
                cfg.n_embd // cfg.n_head),
               ("intermediate_size", hf.get("intermediate_size"), "ffn_hidden", cfg.ffn_hidden),
               ("num_hidden_layers", hf.get("num_hidden_layers"), layers_key, cfg.n_layer),
               ("vocab_size", hf.get("vocab_size"), "the data's padded vocabulary", cfg.vocab_size),
               ("rope_theta", theta, "rope_theta", cfg.rope_theta),
               ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), "norm_eps", cfg.norm_eps),
               ("tie_word_embeddings", hf.get("tie_word_embeddings", False), "tie_embeddings",
                cfg.tie_embeddings)]
    for key, theirs, ours_key, ours in fitting:
        if theirs != ours:
            fix = {"vocab_size": "prepare the data with the model's tokenizer",
                   "num_hidden_layers": f"set {layers_key} to {theirs}",
                   "head_dim": "a model with head_dim = hidden_size / num_attention_heads is needed",
                   }.get(key, f"set --{ours_key}={theirs!r}")
            return f"its {key}={theirs!r} but {ours_key}={ours!r}: {fix}"
    return None


def load_hf(path, cfg, layers_key="n_layer"):
    """A GPT of config `cfg` (stage 1 of a run: every layer trainable) holding the weights of the
    HF LLaMA folder `path`, in fp32. The first field or tensor that does not fit is an error."""
    hf, tensors = read_hf(path)
    why = config_mismatch(hf, cfg, layers_key)
    if why:
        raise UserError(f"hf:{path} does not fit the run's config: {why}")
    model = GPT(cfg)
    names = name_map(cfg.n_layer, cfg.tie_embeddings)
    # HF ignores a stored head when it ties it, and old files keep RoPE's inverse frequencies
    extra = [k for k in tensors if k not in names and not k.endswith("rotary_emb.inv_freq")
             and not (cfg.tie_embeddings and k == "lm_head.weight")]
    missing = [k for k in names if k not in tensors]
    if missing or extra:
        raise UserError(f"hf:{path} holds other tensors than a LLaMA of its config: "
                        + (f"{missing[0]} is missing" if missing else f"{extra[0]} is unexpected"))
    with torch.no_grad():
        for hf_name, ours in names.items():
            w = model.get_submodule(ours).weight
            if tensors[hf_name].shape != w.shape:
                raise UserError(f"hf:{path}: {hf_name} has shape {tuple(tensors[hf_name].shape)}, its config "
                                f"says {tuple(w.shape)}; the folder is damaged")
            w.copy_(tensors[hf_name].float())
    return model
