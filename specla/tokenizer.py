"""The project's tokenizer: a byte-level BPE with 4096 entries, trained on Python code.

    python -m specla.train tokenizer --corpus data/corpus --out assets/

Special tokens (the first ids, so they never move when the vocabulary size changes):
    0  <|endoftext|>   document separator; bos, eos and pad of the model
    1  <|mask|>        reserved for block drafters (the slots to fill); never in the corpus
Byte-level means every byte sequence round-trips exactly: decode(encode(x)) == x for any
text, tabs, newlines and non-ASCII included. No prefix space is added and nothing is
"cleaned up" on decode (transformers' default cleanup would turn "x ." into "x."). The
text "<|endoftext|>" (it occurs in the corpus: GPT-2 tokenizer code) encodes as plain
text, never as id 0: id 0 only ever marks a document boundary that the pipeline inserts
by id (`encode_special_tokens` / `split_special_tokens`).

Saved as tokenizer.json (what `tokenizers` reads) plus tokenizer_config.json and
special_tokens_map.json, so `PreTrainedTokenizerFast.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load it without remote code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]
EOS_ID, MASK_ID = 0, 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass
class TokenizerConfig:
    vocab_size: int = 4096
    min_frequency: int = 2


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=SPECIAL_TOKENS,
        # all 256 bytes up front: no input can hit an unknown token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.encode_special_tokens = True   # not saved in tokenizer.json: load_raw sets it again
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.token_to_id(MASK_TOKEN) == MASK_ID
    return tok


def save_tokenizer(tok: Tokenizer, out: str | Path) -> str:
    """Write the three tokenizer files into `out`; returns the sha256 of tokenizer.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
               "mask_token": MASK_TOKEN}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False,
              "split_special_tokens": True,
              "model_max_length": 1_000_000}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return file_sha256(out / "tokenizer.json")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_raw(folder: str | Path) -> Tokenizer:
    """The `tokenizers` object (no transformers needed): what the data pipeline uses."""
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: train it with `python -m specla.train "
                                "tokenizer --corpus data/corpus --out assets/`")
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


def load_tokenizer(folder: str | Path):
    """A `transformers.PreTrainedTokenizerFast` over the saved files."""
    from transformers import PreTrainedTokenizerFast

    load_raw(folder)  # the clear error when the folder has no tokenizer.json
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def main(argv: list[str] | None = None) -> None:
    """Train on the corpus' training split, save, then write the token files and prompts."""
    import argparse
    import time

    from specla import data

    ap = argparse.ArgumentParser(prog="python -m specla.train tokenizer", description=main.__doc__)
    ap.add_argument("--corpus", default="data/corpus", help="folder written by `corpus`")
    ap.add_argument("--out", default="assets", help="where the tokenizer files go")
    ap.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size)
    ap.add_argument("--examples", default="",
                    help="also write demo prompts (signature + docstring openings) here; the shipped "
                         "examples/prompts.jsonl is curated by hand (tests/test_examples.py checks it)")
    args = ap.parse_args(argv)

    t0 = time.time()
    texts = (text for _, text in data.iter_documents(args.corpus, "train"))
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=args.vocab_size))
    sha = save_tokenizer(tok, args.out)
    t1 = time.time()
    print(f"tokenizer: {tok.get_vocab_size()} entries, trained in {t1 - t0:.1f}s -> {args.out}")
    info = data.write_tokens(args.corpus, tok, EOS_ID, sha)
    t2 = time.time()
    print(f"tokens: train {info['train_tokens']:,}, heldout {info['heldout_tokens']:,} "
          f"({info['train_bytes_per_token']} bytes/token) in {t2 - t1:.1f}s")
    prompts = data.heldout_prompts(args.corpus, tok)
    data.write_jsonl(Path(args.corpus) / "heldout_prompts.jsonl", prompts)
    if args.examples:
        data.write_jsonl(args.examples, data.example_prompts(args.corpus))
    print(f"prompts: {len(prompts)} held-out prompts; demo prompts -> {args.examples or '-'}")
