"""The drafters' training text: continuations the target generated from prompts cut from the
corpus (in the target's own vocabulary), kept as chunks of rows that share a prompt length,
saved beside the training state so that `--resume` reuses them."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from specla.config import GDNConfig

SHARD_BYTES = 12 * 2**20        # files that come back from the GPU machine must stay < 16 MiB


@dataclasses.dataclass
class Chunk:
    tokens: torch.Tensor    # [b, P + N] long, on the training device
    prompt_len: int
    greedy: bool
    eval_rows: int = 0      # the last eval_rows rows are held out (greedy chunks only)

    @property
    def train_rows(self) -> int:
        return self.tokens.shape[0] - self.eval_rows


def generate_corpus(live, train_tokens: np.ndarray, *, seconds: float, max_tokens: int, batch: int,
                    prompt_range=(32, 128), new_range=(128, 256), temperature: float = 0.8,
                    eval_fraction: float = 0.05, seed: int = 0, log=print) -> list[Chunk]:
    """Continuations from the target: alternate greedy and sampled chunks until the time or
    token budget is spent (always at least one of each)."""
    from tqdm import tqdm
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=live.device).manual_seed(seed)
    chunks: list[Chunk] = []
    total, t0 = 0, time.time()
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="generate", mininterval=5)
    while (len(chunks) < 2 or (time.time() - t0 < seconds and total < max_tokens)):
        greedy = len(chunks) % 2 == 0
        P = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        N = int(rng.integers(new_range[0], new_range[1] + 1))
        starts = rng.integers(0, len(train_tokens) - P, size=batch)
        prompts = torch.from_numpy(np.stack([train_tokens[s:s + P] for s in starts]).astype(np.int64))
        prompts = prompts.to(live.device)
        cont = live.generate(prompts, N, 0.0 if greedy else temperature, gen)
        seq = torch.cat([prompts, cont], dim=1)
        eval_rows = max(1, int(round(batch * eval_fraction))) if greedy and batch > 1 else 0
        chunk = Chunk(seq, P, greedy, eval_rows)
        if not chunks and getattr(live, "use_cache", False):
            # The first (greedy) chunk checks the cache loop: a continuation that disagrees with
            # the target's own argmax in one full forward means the state got lost between steps.
            agree = greedy_agreement(live, [chunk])
            log(f"[drafter-train] cache-loop greedy agreement {agree:.4f}")
            if agree < 0.9:
                log("[drafter-train] WARNING: generation through fla's cache disagrees with a full "
                    "forward; regenerating without the cache")
                live.use_cache = False
                continue
        chunks.append(chunk)
        total += batch * N
        bar.update(batch * N)
    bar.close()
    log(f"[drafter-train] generated {total} tokens in {len(chunks)} chunks, {time.time() - t0:.1f} s")
    return chunks


def save_corpus(chunks: list[Chunk], folder: Path, fingerprint: dict) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"target": fingerprint, "chunks": [], "files": []}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        if shard:
            name = f"corpus-{len(meta['files']):04d}.safetensors"
            save_file(shard, str(folder / name))
            meta["files"].append(name)
            shard, size = {}, 0

    for i, c in enumerate(chunks):
        t = c.tokens.to("cpu", torch.int32)
        t = t.to(torch.int16) if int(t.max()) < 2**15 else t
        if size + t.numel() * t.element_size() > SHARD_BYTES:
            flush()
        shard[f"chunk{i}"] = t.contiguous()
        size += t.numel() * t.element_size()
        meta["chunks"].append({"prompt_len": c.prompt_len, "greedy": c.greedy, "eval_rows": c.eval_rows,
                               "file": len(meta["files"])})
    flush()
    (folder / "corpus.json").write_text(json.dumps(meta))


def load_corpus(folder: Path, fingerprint: dict, device) -> list[Chunk] | None:
    from safetensors.torch import load_file
    try:
        meta = json.loads((folder / "corpus.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("target") != fingerprint:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for name in meta["files"]:
        tensors.update(load_file(str(folder / name)))
    return [Chunk(tensors[f"chunk{i}"].long().to(device), c["prompt_len"], c["greedy"], c["eval_rows"])
            for i, c in enumerate(meta["chunks"])]


def sample_batch(chunks: list[Chunk], seqs: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """`seqs` training rows of one chunk (rows of a chunk share their prompt length)."""
    weights = torch.tensor([float(c.train_rows) for c in chunks])
    c = chunks[int(torch.multinomial(weights, 1, generator=gen))]
    rows = torch.randint(0, c.train_rows, (seqs,), generator=gen)
    return c.tokens[rows.to(c.tokens.device)], c.prompt_len


def greedy_agreement(live, chunks: list[Chunk], rows: int = 16) -> float | None:
    """How often a greedy continuation equals the target's argmax in a full forward: ~1.0
    unless generation lost its state between steps (or bf16 near-ties)."""
    for c in chunks:
        if c.greedy:
            toks = c.tokens[:rows]
            logits = live.run(toks).logits
            P = c.prompt_len
            return float((logits[:, P - 1:-1].argmax(-1) == toks[:, P:]).float().mean())
    return None


def prompt_tokens(data: Path, target: Path, config: GDNConfig, cache: Path) -> np.ndarray:
    """Token ids to cut generation prompts from, in the target's vocabulary.

    `data`/train.bin as it is when the target has no tokenizer.json or its tokenizer wrote
    that file (tokens.json records the tokenizer's sha256); otherwise the corpus text
    (`data`/train.txt.gz) tokenized with the target's own tokenizer, once, kept in `cache`.
    """
    from specla.data import tokenize_split
    from specla.tokenizer import file_sha256, load_raw

    own = target / "tokenizer.json"
    data_info = data / "tokens.json"
    written_by = json.loads(data_info.read_text()).get("tokenizer_sha256") if data_info.exists() else None
    if own.exists() and written_by != file_sha256(own):
        if not (data / "train.txt.gz").exists():
            raise ValueError(f"{data}/train.bin was not written with {own} and {data} has no corpus "
                             f"text (train.txt.gz) to tokenize with it: build one with "
                             f"`python -m specla.train corpus --out {data}`")
        if config.vocab_size > 65536:
            raise ValueError(f"token files are uint16: a vocabulary of {config.vocab_size} does not fit")
        sha = file_sha256(own)
        path = cache / f"train-{sha[:16]}.bin"
        if not path.exists():
            eos = config.eos_token_id if config.eos_token_id is not None else (config.bos_token_id or 0)
            print(f"[drafter-train] tokenizing {data} with {own} (once; kept in {path})")
            ids = tokenize_split(data, "train", load_raw(target), eos)
            cache.mkdir(parents=True, exist_ok=True)
            ids.tofile(path)
    else:
        path = data / "train.bin"
    if not path.exists():
        raise ValueError(f"{path} not found: run `python -m specla.train tokenizer --corpus {data}` "
                         "(or give the target a tokenizer.json and the corpus text)")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if tokens.size and int(tokens.max()) >= config.vocab_size:
        raise ValueError(f"{path} holds token id {int(tokens.max())}, but the target's vocabulary has "
                         f"{config.vocab_size} entries: tokenize the corpus with the target's tokenizer "
                         "(put its tokenizer.json in the target folder)")
    return tokens
