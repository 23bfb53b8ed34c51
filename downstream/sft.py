"""Instruction-tune an exported model (export_hf.py) with Hugging Face TRL's SFTTrainer on an
Alpaca-format JSON file: a list of {"instruction", "input" (may be empty), "output"}.

    python downstream/sft.py hf-step-small tests/data/alpaca_tiny.json sft-step-small     # CPU, seconds
    python downstream/sft.py hf-step-350m alpaca_data.json sft-step-350m --epochs 3 --lr 2e-5 \\
        --batch_size 16 --grad_accum 8                                   # a GPU: Alpaca's own settings

Each record becomes a prompt (Alpaca's template, with or without its Input section) and a
completion (the output, then <|endoftext|>); the loss is on the completion only
(completion_only_loss). The template is the tokenizer's chat template, saved with the model, so
`tok.apply_chat_template([{"role": "user", "content": "..."}], add_generation_prompt=True)` gives a
prompt as in training (an Input section is a message of role "input"); the pad token is
<|endoftext|>, masked out of the loss like the prompt. The output folder (written as OUT.tmp and
renamed when done) loads in transformers and lm-eval like the exported one, plus sft.json with the
settings and the training loss. Alpaca's 52k records: github.com/tatsu-lab/stanford_alpaca
(alpaca_data.json). Needs trl: pip install -r requirements-test.txt
"""
import argparse
import json
import os
import shutil

HEADER = {False: "Below is an instruction that describes a task. Write a response that appropriately "
                 "completes the request.",
          True: "Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request."}
# Alpaca's prompt as a chat template: user -> Instruction, input -> Input, assistant -> Response + eos
CHAT_TEMPLATE = (
    "{%- set has_input = messages | selectattr('role', 'equalto', 'input') | list | length > 0 -%}"
    "{{- '" + HEADER[True] + "' if has_input else '" + HEADER[False] + "' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' %}{{ '\\n\\n### Instruction:\\n' + m['content'] }}"
    "{%- elif m['role'] == 'input' %}{{ '\\n\\n### Input:\\n' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{ '\\n\\n### Response:\\n' + m['content'] + eos_token }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '\\n\\n### Response:\\n' }}{% endif -%}")


def alpaca_prompt(instruction, input=""):
    """The prompt as Stanford Alpaca's train.py writes it (what CHAT_TEMPLATE renders)."""
    section = f"\n\n### Input:\n{input}" if input else ""
    return f"{HEADER[bool(input)]}\n\n### Instruction:\n{instruction}{section}\n\n### Response:\n"


def read_alpaca(path):
    """-> the records of an Alpaca-format JSON file; a one-line error on anything else."""
    form = 'a JSON list of {"instruction", "input", "output"} (Alpaca\'s format)'
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: no such file: {path} (instruction data: {form})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path} is not JSON ({e}); instruction data is {form}") from None
    if not isinstance(records, list) or not records:
        raise SystemExit(f"error: {path} holds no records; instruction data is {form}")
    for i, r in enumerate(records):
        r = r if isinstance(r, dict) else {}
        bad = [k for k in ("instruction", "output") if not isinstance(r.get(k), str)]
        if bad or not isinstance(r.get("input", ""), str):
            raise SystemExit(f"error: {path}: record {i} has no string {(bad or ['input'])[0]!r}; each "
                             f"record is {form}")
    return records


def conversation(record):
    """An Alpaca record as TRL's conversational prompt-completion example."""
    prompt = [{"role": "user", "content": record["instruction"]}]
    if record.get("input"):
        prompt.append({"role": "input", "content": record["input"]})
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": record["output"]}]}


def build_trainer(a, records, output_dir):
    """-> (TRL's SFTTrainer for the model folder a.model on the records, how many examples it cuts)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.pad_token = tok.eos_token   # the export has none; padded positions are out of the loss
    tok.chat_template = CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, use_safetensors=True)
    max_length = a.max_length or model.config.max_position_embeddings
    examples = [conversation(r) for r in records]
    lengths = [(len(tok.apply_chat_template(e["prompt"], add_generation_prompt=True)),
                len(tok.apply_chat_template(e["prompt"] + e["completion"]))) for e in examples]
    if all(prompt >= max_length for prompt, _ in lengths):
        raise SystemExit(f"error: every prompt is {max_length} tokens or longer, which leaves no room for a "
                         "response: give a larger --max_length, or shorter instructions")
    cut = sum(full > max_length for _, full in lengths)
    if cut:
        print(f"warning: {cut} of {len(examples)} examples are longer than {max_length} tokens: their ends "
              "are cut (those whose prompt alone fills them are left out)")
    cuda = torch.cuda.is_available()
    config = SFTConfig(output_dir=output_dir, num_train_epochs=a.epochs, learning_rate=a.lr,
                       lr_scheduler_type="cosine", warmup_steps=0.03, weight_decay=0.0,
                       per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
                       max_length=max_length, completion_only_loss=True, use_cpu=not cuda,
                       bf16=cuda and torch.cuda.is_bf16_supported(), seed=a.seed,
                       logging_steps=max(1, len(examples) // (a.batch_size * a.grad_accum) // 2),
                       save_strategy="no", report_to="none", disable_tqdm=True,
                       activation_checkpointing=False)   # TRL's default: memory none of our models needs
    data = Dataset.from_list(examples)
    return SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok), cut


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a Hugging Face folder from export_hf.py")
    p.add_argument("data", help="Alpaca-format JSON file")
    p.add_argument("out", help="the folder to write (must not exist)")
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (cosine decay, 3%% warmup)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--max_length", type=int, default=0, help="tokens per example (0: the model's context)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):   # weights as data, not a pickle
        if not os.path.isfile(os.path.join(a.model, name)):
            raise SystemExit(f"error: {a.model} has no {name}: give a folder written by export_hf.py from a "
                             "checkpoint with a cl100k tokenizer")
    out = os.path.normpath(a.out)
    if os.path.exists(out):
        raise SystemExit(f"error: {out} exists: remove it or choose another output folder")
    records = read_alpaca(a.data)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)   # left by a killed run
    trainer, cut = build_trainer(a, records, tmp)
    result = trainer.train()
    trainer.save_model(tmp)   # the model, and the tokenizer with its chat template and pad token
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    summary = {"model": a.model, "data": a.data, "examples": len(records), "cut": cut, "epochs": a.epochs,
               "lr": a.lr, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
               "max_length": trainer.args.max_length, "seed": a.seed, "steps": result.global_step,
               "train_loss": result.training_loss, "first_loss": losses[0], "last_loss": losses[-1]}
    with open(os.path.join(tmp, "sft.json"), "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, out)
    print(f"wrote {out}: {len(records)} examples x {a.epochs:g} epochs, {result.global_step} steps, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
