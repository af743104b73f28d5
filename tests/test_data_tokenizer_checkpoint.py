"""Corpus split, tokenizer round trip, checkpoint save/load (ours and fla's), target training.

CPU only and fast: tiny tokenizers, tiny models, a packages-only mini corpus.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specla import data, tokenizer as tk
from specla.checkpoint import load_model, save_model
from specla.config import GDNConfig, ModelFormatError
from specla.model import GDNForCausalLM, Topology

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY = GDNConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                 expand_v=1.0, intermediate_size=64, tie_word_embeddings=True,
                 bos_token_id=0, eos_token_id=0)
SAMPLES = [
    "def f(x):\n\treturn x  # tab-indented\n",
    "class A:\n    def __init__(self):\n        self.s = 'héllo wörld ✓ 中文 🚀'\n",
    "x = [1 , 2 ,3 ]  ;  y = x . copy( )\r\n\r\n  \n",   # spaces a decoder 'cleanup' would eat
    "\"\"\"Docstring.\n\n    Indented   text\twith\ttabs.\n\"\"\"\n\n\n",
    "<|endoftext|> is text here, and so is \\x00 and \x7f",
]


# ---------------------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    texts = [s * 20 for s in SAMPLES] + ["import os\nimport sys\n" * 50]
    tok = tk.train_tokenizer(texts, tk.TokenizerConfig(vocab_size=300))
    out = tmp_path_factory.mktemp("tok")
    tk.save_tokenizer(tok, out)
    return out


def tokenizer_dirs():
    yield pytest.param("tiny", id="tiny")
    yield pytest.param("assets", id="assets", marks=pytest.mark.skipif(
        not (ASSETS / "tokenizer.json").exists(), reason="assets/tokenizer.json not built"))


@pytest.mark.parametrize("which", tokenizer_dirs())
@pytest.mark.parametrize("text", SAMPLES, ids=[f"S{i}" for i in range(len(SAMPLES))])
def test_tokenizer_round_trip(which, text, tiny_tokenizer_dir):
    folder = tiny_tokenizer_dir if which == "tiny" else ASSETS
    raw = tk.load_raw(folder)
    assert raw.decode(raw.encode(text).ids) == text
    fast = tk.load_tokenizer(folder)
    ids = fast.encode(text)
    assert ids == raw.encode(text).ids            # no bos/eos added behind our back
    assert fast.decode(ids) == text


def test_tokenizer_files_and_special_tokens(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    for name in tk.TOKENIZER_FILES:
        assert (tiny_tokenizer_dir / name).exists()
    auto = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))  # no trust_remote_code
    assert auto.eos_token_id == auto.bos_token_id == auto.pad_token_id == tk.EOS_ID == 0
    assert auto.convert_tokens_to_ids(tk.MASK_TOKEN) == tk.MASK_ID == 1
    assert auto.decode(auto.encode(SAMPLES[2])) == SAMPLES[2]


# ---------------------------------------------------------------------------- corpus

@pytest.fixture(scope="module")
def mini_corpus(tmp_path_factory) -> Path:
    req = tmp_path_factory.mktemp("req") / "requirements.txt"
    req.write_text("tqdm==4.70.1\neinops  # comment\nnot-installed-package==1.0\n")
    out = tmp_path_factory.mktemp("corpus")
    cfg = data.CorpusConfig(target_mb=0.2, heldout_per_mille=200, requirements=str(req), stdlib=False)
    data.build_corpus(out, cfg)
    return out


def test_heldout_split_is_by_file_and_deterministic(mini_corpus, tmp_path):
    manifest = data.load_manifest(mini_corpus)
    assert manifest["missing_packages"] == ["not-installed-package"]
    files = manifest["files"]
    assert files and [f["relpath"] for f in files] == sorted(f["relpath"] for f in files)
    assert {f["split"] for f in files} == {"train", "heldout"}
    for f in files:   # the split is a function of the path alone
        assert (f["split"] == "heldout") == data.is_heldout(f["relpath"], 200)
    held = dict(data.iter_documents(mini_corpus, "heldout"))
    train = dict(data.iter_documents(mini_corpus, "train"))
    assert not set(held) & set(train)
    for rel, text in {**held, **train}.items():
        assert text.startswith(data.SEPARATOR.format(rel))
    # The same inputs give byte-identical text.
    again = data.build_corpus(tmp_path, data.CorpusConfig(**manifest["config"]))
    assert again["splits"] == manifest["splits"]
    # The rule itself: stable across calls, ~2% at the default rate.
    paths = [f"pkg/mod_{i}.py" for i in range(20000)]
    share = sum(map(data.is_heldout, paths)) / len(paths)
    assert 0.015 < share < 0.025
    assert [data.is_heldout(p) for p in paths[:500]] == [data.is_heldout(p) for p in paths[:500]]


def test_token_files_and_prompts(mini_corpus, tiny_tokenizer_dir):
    raw = tk.load_raw(tiny_tokenizer_dir)
    info = data.write_tokens(mini_corpus, raw, tk.EOS_ID, "test")
    train = data.load_tokens(mini_corpus, "train")
    assert train.dtype == np.uint16 and train.size == info["train_tokens"]
    docs = list(data.iter_documents(mini_corpus, "train"))
    assert int((train == tk.EOS_ID).sum()) >= len(docs)   # a separator before every document
    first = raw.encode(docs[0][1]).ids
    assert train[0] == tk.EOS_ID and list(train[1:1 + len(first)]) == first
    prompts = data.heldout_prompts(mini_corpus, raw, n=4, prefix_tokens=16, continuation_tokens=8)
    assert prompts and all(p["file"] in dict(data.iter_documents(mini_corpus, "heldout")) for p in prompts)
    assert prompts == data.heldout_prompts(mini_corpus, raw, n=4, prefix_tokens=16, continuation_tokens=8)


def test_editing_prompts_repeat_a_held_out_function_renamed(mini_corpus, tiny_tokenizer_dir):
    raw = tk.load_raw(tiny_tokenizer_dir)
    prompts = data.editing_prompts(mini_corpus, raw, n=6, continuation_tokens=16)
    assert len(prompts) == 6
    assert prompts == data.editing_prompts(mini_corpus, raw, n=6, continuation_tokens=16)
    held = dict(data.iter_documents(mini_corpus, "heldout"))
    for i, p in enumerate(prompts):
        edit = p["edit"]
        assert edit["kind"] == data.EDITS[i % 2] and edit["new"] != edit["old"]
        original, head = p["prompt"].rsplit("\n\n", 1)      # the original, a blank line, the copy's first line
        original += "\n"
        assert original.splitlines()[0].strip() in held[p["file"]]
        assert data._rename(original, edit["old"], edit["new"]).startswith(head + p["continuation"])
        assert len(raw.encode(p["continuation"]).ids) >= 15
        if edit["kind"] == "rename-function":
            assert head.removeprefix("async ").startswith(f"def {edit['new']}(")


# ---------------------------------------------------------------------------- checkpoint

def bf16_model(config: GDNConfig, seed: int = 0) -> GDNForCausalLM:
    """A random model whose weights are exactly representable in bf16 (the stored dtype)."""
    torch.manual_seed(seed)
    model = GDNForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model.eval()


def logits(model: GDNForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, model.new_state(tokens.shape[0]),
                     Topology.chain(tokens.shape[1], model.config.conv_size)).logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shard_bytes", [15 * 2**20, 20_000], ids=["one-file", "sharded"])
def test_checkpoint_round_trip(tmp_path, tied, shard_bytes, tiny_tokenizer_dir):
    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = bf16_model(config)
    written = save_model(model, config, tmp_path, tokenizer_dir=tiny_tokenizer_dir,
                         max_shard_bytes=shard_bytes)
    assert all(p.stat().st_size < 15 * 2**20 for p in written)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 15 * 2**20)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gated_deltanet"
    loaded, tokenizer, report = load_model(tmp_path)
    assert report.unused_tensors == [] and report.dtype == "torch.float32"
    assert report.stored_dtypes == {"torch.bfloat16": len(loaded.state_dict()) - tied}
    assert (loaded.lm_head.weight is loaded.model.embeddings.weight) == tied
    assert tokenizer is not None and tokenizer.decode(tokenizer.encode(SAMPLES[0])) == SAMPLES[0]
    tokens = torch.randint(0, config.vocab_size, (2, 7))
    assert torch.equal(logits(model, tokens), logits(loaded, tokens))
    assert load_model(tmp_path, dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def _fla():
    try:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    except ImportError as err:
        pytest.skip(f"fla.models is not importable here ({err})")
    return GatedDeltaNetConfig, GatedDeltaNetForCausalLM


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_fla_save_pretrained(tmp_path, tied):
    FlaConfig, FlaModel = _fla()
    torch.manual_seed(0)
    fla_model = FlaModel(FlaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                   head_dim=16, expand_v=1.0, intermediate_size=64,
                                   tie_word_embeddings=tied))
    fla_model.save_pretrained(tmp_path)   # fp32 safetensors, fla's own config.json
    ours, tokenizer, report = load_model(tmp_path)
    assert tokenizer is None and report.unused_tensors == []
    theirs = fla_model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_fla_loads_our_checkpoint(tmp_path):
    _, FlaModel = _fla()
    model = bf16_model(TINY)
    save_model(model, TINY, tmp_path, max_shard_bytes=20_000)
    fla_model = FlaModel.from_pretrained(str(tmp_path))
    theirs = fla_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name].float()), name


@pytest.fixture
def saved(tmp_path) -> Path:
    save_model(bf16_model(TINY), TINY, tmp_path / "ckpt", max_shard_bytes=20_000)
    return tmp_path / "ckpt"


def test_error_missing_folder(tmp_path):
    with pytest.raises(ModelFormatError, match="no such checkpoint folder"):
        load_model(tmp_path / "nope" / "deeper" / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(tmp_path / "empty")


def test_error_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFormatError, match="offline.*local folder"):
        load_model("someone/some-gdn-model")


def test_error_no_weights_and_pickle(saved):
    for f in saved.glob("model*"):
        f.unlink()
    with pytest.raises(ModelFormatError, match="no weights"):
        load_model(saved)
    (saved / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelFormatError, match="safetensors only"):
        load_model(saved)


def test_error_corrupt_safetensors(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    with pytest.raises(ModelFormatError, match=shard.name):
        load_model(saved)


def test_error_wrong_model_type(saved):
    raw = json.loads((saved / "config.json").read_text())
    raw["model_type"] = "llama"
    (saved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match="model_type is 'llama'"):
        load_model(saved)


def test_error_shape_mismatch_and_missing_tensor(tmp_path):
    state = bf16_model(TINY).state_dict()
    bad = dict(state)
    bad["model.layers.1.attn.A_log"] = torch.zeros(3)
    save_model(bad, TINY, tmp_path / "shape")
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.attn\.A_log has shape \[3\].*\[2\]"):
        load_model(tmp_path / "shape")
    missing = {k: v for k, v in state.items() if k != "model.layers.0.mlp.up_proj.weight"}
    save_model(missing, TINY, tmp_path / "missing")
    with pytest.raises(ModelFormatError, match=r"missing tensors model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(tmp_path / "missing")


def test_legacy_tensors_are_reported_not_fatal(tmp_path):
    model = bf16_model(TINY)
    state = dict(model.state_dict())
    state["model.layers.0.attn.legacy_scale"] = torch.ones(4)
    state["model.rotary.inv_freq"] = torch.ones(8)
    save_model(state, TINY, tmp_path)
    loaded, _, report = load_model(tmp_path)
    assert report.unused_tensors == ["model.layers.0.attn.legacy_scale", "model.rotary.inv_freq"]
    tokens = torch.randint(0, TINY.vocab_size, (1, 5))
    assert torch.equal(logits(model, tokens), logits(loaded, tokens))


# ---------------------------------------------------------------------------- training

def test_target_training_smoke(tmp_path):
    """A few steps of the torch backend on a learnable synthetic stream: loss goes down."""
    from specla.train import target

    rng = np.random.default_rng(0)
    # Repeated 'words' of 4 tokens drawn from a small set: predictable after the first token.
    words = rng.integers(2, 64, size=(16, 4))
    stream = np.concatenate([[0]] + [words[i] for i in rng.integers(0, 16, size=3000)]).astype(np.uint16)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stream[:10000].tofile(corpus / "train.bin")
    stream[10000:].tofile(corpus / "heldout.bin")
    (corpus / "tokens.json").write_text(json.dumps({"vocab_size": 64, "dtype": "uint16", "eos_id": 0}))
    cfg = target.TrainConfig(max_steps=24, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                             eval_every=8, eval_windows=8, patience=10)
    summary = target.train(corpus, tmp_path / "run", target.MODEL_CONFIGS["tiny"], cfg, "torch",
                           torch.device("cpu"), tokenizer_dir=None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [8, 16, 24]
    assert rows[-1]["heldout_loss"] < rows[0]["heldout_loss"] - 0.3
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert summary["steps"] == 24 and summary["tokens_seen"] == 24 * 4 * 32
    assert summary["best_heldout_loss"] == pytest.approx(min(r["heldout_loss"] for r in rows), abs=1e-4)
    model, _, report = load_model(tmp_path / "run" / "export")
    assert model.config.vocab_size == 64 and report.unused_tensors == []
    assert (tmp_path / "run" / "ckpt" / "state.json").exists()

    # Resume: continues from step 24 to 32 with the saved optimizer and RNG.
    cfg.max_steps = 32
    summary = target.train(corpus, tmp_path / "run", target.MODEL_CONFIGS["tiny"], cfg, "torch",
                           torch.device("cpu"), tokenizer_dir=None, resume=True)
    assert summary["steps"] == 32
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [8, 16, 24, 32]

    # A second stage from the export: a fresh optimizer, a step-0 eval, and both stages counted.
    stage2 = target.TrainConfig(max_steps=8, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                                eval_every=4, eval_windows=8, patience=10)
    summary2 = target.train(corpus, tmp_path / "stage2", target.MODEL_CONFIGS["tiny"], stage2, "torch",
                            torch.device("cpu"), tokenizer_dir=None, init=tmp_path / "run" / "export",
                            init_summary=summary)
    rows2 = [json.loads(line) for line in (tmp_path / "stage2" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows2] == [0, 4, 8]
    # Step 0 is the export itself: its held-out loss equals the first stage's best (bf16 export).
    assert rows2[0]["heldout_loss"] == pytest.approx(summary["best_heldout_loss"], abs=0.05)
    assert summary2["steps"] == 32 + 8 and len(summary2["stages"]) == 2
    assert summary2["stages"][1]["init_heldout_loss"] == pytest.approx(rows2[0]["heldout_loss"], abs=1e-4)
    assert "| stage 2 | from stage 1's best weights: 8 steps" in target.render_card(summary2)
    # The starting weights compete for best: with lr 0 nothing changes and they are exported.
    frozen = dataclasses.replace(stage2, lr=0.0)
    summary3 = target.train(corpus, tmp_path / "stage3", target.MODEL_CONFIGS["tiny"], frozen, "torch",
                            torch.device("cpu"), tokenizer_dir=None, init=tmp_path / "run" / "export")
    assert summary3["best_step"] == 0
    start, _, _ = load_model(tmp_path / "run" / "export")
    end, _, _ = load_model(tmp_path / "stage3" / "export")
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), end.state_dict().values()))
    with pytest.raises(ValueError, match="does not match"):
        small = dataclasses.replace(target.MODEL_CONFIGS["tiny"], hidden_size=32)
        target.train(corpus, tmp_path / "bad", small, stage2, "torch", torch.device("cpu"),
                     tokenizer_dir=None, init=tmp_path / "run" / "export")


def test_inference_caches_follow_in_place_weight_updates():
    """An optimizer step writes the weights in place; an eval under no_grad right after must
    use them, not the q|k|v|a|b(|g) concatenation or conv taps cached at the previous eval."""
    torch.manual_seed(0)
    model = GDNForCausalLM(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 6))

    def logits(m):
        with torch.no_grad():
            return m(tokens, m.new_state(), Topology.chain(6, TINY.conv_size), mode="tree").logits

    logits(model)                                   # builds the caches
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name or "conv1d" in name:
                p.mul_(1.5).add_(0.01)              # in place: same storage, new version
    fresh = GDNForCausalLM(TINY)
    fresh.load_state_dict(model.state_dict())
    assert torch.allclose(logits(model), logits(fresh), atol=1e-5)


def test_card_and_command_dispatch(capsys):
    from specla.train import __main__ as cli
    from specla.train.target import render_card

    card = render_card({"parameters": 13_135_176, "tokens_seen": 10**8, "steps": 3000,
                        "final_train_loss": 1.5, "best_heldout_loss": 1.6, "best_heldout_ppl": 4.95,
                        "best_step": 3000, "minutes": 7.0, "device": "NVIDIA H200",
                        "tokens_per_second": 240_000, "stopped": "time budget",
                        "versions": {"torch": "2.11.0", "fla": "0.6.0"}})
    assert "13,135,176" in card and "NVIDIA H200" in card and "<!-- drafters -->" in card
    assert "## Drafters" in card and "pending" not in card.split("## Data")[0]
    assert cli.main([]) == 0 and "target" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
