"""Any GDN checkpoint: the app starts on a foreign fla checkpoint and decodes with the
model-free drafter, and `python -m specla train drafter --target PATH` trains the three
trained drafters for it, end to end (a tiny random target, a few steps)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specla import data, runner
from specla import tokenizer as tk
from specla.decode import DecodeSettings, ar_generate

ASSETS = Path(__file__).resolve().parents[1] / "assets"


pytestmark = pytest.mark.usefixtures("one_thread")     # tiny models: two threads thrash a small CPU


def fla_checkpoint(folder: Path, vocab: int, tokenizer_dir: Path) -> Path:
    """A random-weight fla GatedDeltaNetForCausalLM, saved as fla saves it, plus a tokenizer.

    Weights are drawn large (as tests/helpers.random_target does) so that greedy decoding
    has no near-ties for rounding to flip."""
    fla_models = pytest.importorskip("fla.models", reason="fla.models is not importable here")
    torch.manual_seed(0)
    model = fla_models.GatedDeltaNetForCausalLM(fla_models.GatedDeltaNetConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
        intermediate_size=64, eos_token_id=None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            torch.nn.init.normal_(p, std=0.3 if name.endswith(("A_log", "dt_bias")) else 0.5)
    model.save_pretrained(folder)
    for name in tk.TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def decoded(runtime: runner.Runtime, prompt: str, settings: dict) -> tuple[list[int], list[int]]:
    """(the app's output tokens, AR's) for one run through `runner.run`."""
    trace = list(runner.run(runtime, prompt, settings))[-1]
    ar = ar_generate(runtime.target, runtime.encode(prompt),
                     DecodeSettings(max_new_tokens=settings["max_new_tokens"],
                                    stop_at_eos=runtime.eos_token_id is not None), runtime.eos_token_id)
    return trace["output"]["tokens"], ar.tokens


@pytest.mark.skipif(not (ASSETS / "drafters").is_dir(), reason="assets/drafters absent")
def test_a_foreign_checkpoint_starts_with_a_note_and_decodes_with_ngram(tmp_path):
    folder = fla_checkpoint(tmp_path / "foreign", 4096, ASSETS)
    runtime = runner.load_runtime(str(folder), device="cpu")      # default drafters folder
    assert list(runtime.drafters) == ["ngram", "oracle"]
    assert runtime.labels["ngram"] == "n-gram (model-free)"
    assert "block, lilicorr, eagle" in runtime.note and "trained for another target" in runtime.note
    prompt = "def f(x):\n    return x + 1\n\ndef f(x):\n    return"
    for tree in ("chain", "best-first"):
        spec, ar = decoded(runtime, prompt, {"drafter": "ngram", "tree": tree, "top_k": 3, "budget": 8,
                                              "max_new_tokens": 24})
        assert spec == ar and len(spec) == 24


@pytest.fixture(scope="module")
def mini_corpus(tmp_path_factory) -> Path:
    req = tmp_path_factory.mktemp("req") / "requirements.txt"
    req.write_text("einops\ntqdm\n")
    out = tmp_path_factory.mktemp("corpus")
    data.build_corpus(out, data.CorpusConfig(target_mb=0.2, heldout_per_mille=200, requirements=str(req),
                                             stdlib=False))
    return out


def test_train_drafter_for_a_new_target_end_to_end(mini_corpus, tmp_path):
    """The corpus has no token file for this target's tokenizer: the command tokenizes the
    text with it, trains all three kinds for a few steps, and the app loads them all."""
    from specla.cli import main
    tok_dir = tmp_path / "tok"
    texts = (text for _, text in data.iter_documents(mini_corpus, "train"))
    tk.save_tokenizer(tk.train_tokenizer(texts, tk.TokenizerConfig(vocab_size=300)), tok_dir)
    target = fla_checkpoint(tmp_path / "target", 300, tok_dir)
    out, state = tmp_path / "drafters", tmp_path / "state"
    assert main(["train", "drafter", "--target", str(target), "--data", str(mini_corpus), "--out", str(out),
                 "--state", str(state), "--device", "cpu", "--max-steps", "2", "--gen-batch", "2",
                 "--gen-tokens", "1", "--width", "32", "--heads", "2", "--mlp-hidden", "64",
                 "--head-width", "32", "--head-heads", "2", "--eagle-mlp-hidden", "64", "--window", "8",
                 "--seqs", "2", "--anchors", "4"]) == 0
    assert len(list((state / "tokens").glob("train-*.bin"))) == 1      # tokenized with its tokenizer
    runtime = runner.load_runtime(str(target), drafters=str(out), device="cpu")
    assert list(runtime.drafters) == ["block", "lilicorr", "eagle", "ngram", "oracle"]
    assert runtime.note == ""
    for kind in ("block", "lilicorr", "eagle"):
        spec, ar = decoded(runtime, "import os\n", {"drafter": kind, "tree": "best-first", "budget": 6,
                                                    "max_new_tokens": 12})
        assert spec == ar, kind


def test_train_drafter_refuses_tokens_outside_the_vocabulary(tmp_path):
    import numpy as np

    from specla.train.drafter import prompt_tokens
    from specla.config import GDNConfig
    (tmp_path / "data").mkdir()
    np.array([1, 2, 400], dtype=np.uint16).tofile(tmp_path / "data" / "train.bin")
    config = GDNConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="token id 400, but the target's vocabulary has 300"):
        prompt_tokens(tmp_path / "data", tmp_path, config, tmp_path / "cache")
