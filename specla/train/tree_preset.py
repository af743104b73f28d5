"""A block drafter's measured tree preset: the fixed draft tree that accepts the most, on
average, of the drafter's own candidates.

The block drafter predicts every slot of a block from the same context, so a node's
children are its depth's slot candidates whatever its path. Run greedy chains over prompts
of the training split, and record at each step the rank, among slot d's candidates, of
the token the target went on to produce there, up to the first slot where it is not a
candidate. A tree node at index path (r1, ..., rd) is accepted at exactly the steps whose
ranks begin with that path, so the tree of `budget` nodes with the most expected accepted
drafts over the recorded steps takes the most frequent paths first (`empirical_preset`; a
child is never more frequent than its parent). The older choice multiplies per-slot rank
chances p[d][r] as if the slots were independent (`best_preset`, `--select table`); it
loses how a slot's rank follows the ranks before it, and accepts less on held-out prompts.

    python -m specla.train tree-preset --drafter assets/drafters/block --corpus data/corpus

writes `tree_preset` (its index paths, the table, how it was measured, and the tau of it and
the alternatives on the training split and on held-out prompts) into the drafter's
drafter.json. The runner offers it as the drafter's preset `measured`; verification of a
preset of up to 15 nodes is one persistent launch on a GPU (`kernels/triton_verify_step.py`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm


def true_ranks(candidates: list[list[int]], future: list[int]) -> list[int]:
    """The rank of each slot's true token among its candidates, up to the first slot where
    it is not among them (that slot's entry is -1, and the list ends there)."""
    ranks = []
    for slot, cands in enumerate(candidates):
        if slot >= len(future):
            break
        ranks.append(cands.index(future[slot]) if future[slot] in cands else -1)
        if ranks[-1] < 0:
            break
    return ranks


def rank_acceptance(steps: list[list[int]], slots: int, top_k: int) -> list[list[float]]:
    """p[d][r]: of the steps that reached slot d, the share whose true token at d was rank r."""
    hits = [[0] * top_k for _ in range(slots)]
    reached = [0] * slots
    for ranks in steps:
        for d, r in enumerate(ranks[:slots]):
            reached[d] += 1
            if 0 <= r < top_k:
                hits[d][r] += 1
    return [[h / reached[d] if reached[d] else 0.0 for h in hits[d]] for d in range(slots)]


def best_preset(table: list[list[float]], budget: int) -> list[list[int]]:
    """The `budget` index paths of highest chance (ties: shallower, then lower ranks first),
    listed by depth, then by chance: parents before children."""
    chance = {(): 1.0}
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < budget:
        best = None
        for path, p in chance.items():
            if len(path) >= len(table):
                continue
            for r, q in enumerate(table[len(path)]):
                child = path + (r,)
                if child in chance or q <= 0:
                    continue
                key = (p * q, -len(child), tuple(-x for x in child))
                if best is None or key > best[0]:
                    best = (key, child)
                break               # ranks are tried in order: the first one not taken is the best
        if best is None:
            break
        chance[best[1]] = best[0][0]
        chosen.append(best[1])
    chosen.sort(key=lambda path: (len(path), -chance[path], path))
    return [list(path) for path in chosen]


def empirical_preset(steps: list[list[int]], budget: int) -> list[list[int]]:
    """The `budget` index paths that the most recorded steps accepted through: each step's
    ranks give the paths it would accept (every prefix before its first miss), and the tree
    of most expected accepted drafts over those steps takes the most frequent first. Unlike
    `best_preset` it keeps what the table loses: how a slot's rank depends on the ranks
    before it. A child is never more frequent than its parent, and a tie puts the shallower
    first, so the result is a tree; listed by depth, then frequency: parents first."""
    counts: dict[tuple[int, ...], int] = {}
    for ranks in steps:
        prefix: tuple[int, ...] = ()
        for r in ranks:
            if r < 0:
                break
            prefix += (r,)
            counts[prefix] = counts.get(prefix, 0) + 1
    chosen = sorted(counts, key=lambda path: (-counts[path], len(path), path))[:budget]
    chosen.sort(key=lambda path: (len(path), -counts[path], path))
    return [list(path) for path in chosen]


def expected_tau(table: list[list[float]], paths: list[list[int]]) -> float:
    """1 + the expected accepted drafts of a preset under the table."""
    total = 0.0
    for path in paths:
        p = 1.0
        for d, r in enumerate(path):
            p *= table[d][r]
        total += p
    return 1.0 + total


def measured_tau(steps: list[list[int]], paths: list[list[int]]) -> float:
    """1 + the mean accepted drafts of a preset over recorded steps."""
    nodes, total = {tuple(p) for p in paths}, 0
    for ranks in steps:
        prefix: tuple[int, ...] = ()
        for r in ranks:
            prefix += (r,)
            if r < 0 or prefix not in nodes:
                break
            total += 1
    return 1.0 + total / max(len(steps), 1)


def record_ranks(target, drafter, tokenizer, prompts: list[str], top_k: int, new_tokens: int) -> list[list[int]]:
    """Per step of greedy block chains, `true_ranks` of the drafter's top-k slot candidates."""
    from specla.decode import DecodeSettings, ar_generate, speculative_steps
    from specla.drafters.base import DraftSettings

    block = drafter.net.config.block_size
    settings = DraftSettings(tree="chain", block_size=block, top_k=top_k, budget=block - 1)
    steps = []
    for prompt in tqdm(prompts, desc="prompts"):
        ids = tokenizer.encode(prompt)
        # AR runs a block past the end, so the last step's slots have their true tokens too
        truth = ar_generate(target, ids, DecodeSettings(max_new_tokens=new_tokens + block)).tokens
        done = 0
        for record in speculative_steps(target, drafter, ids, DecodeSettings(max_new_tokens=new_tokens), settings):
            steps.append(true_ranks(record.details["slots"]["candidates"], truth[done:]))
            done += len(record.new_tokens)
    return steps


def read_prompt_file(path: str | Path, n: int) -> list[str]:
    """The first n prompts of a JSON Lines file ({"prompt": ...} a line)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["prompt"] for row in rows[:n]]


def main(argv: list[str] | None = None) -> None:
    from specla.checkpoint import load_model
    from specla.data import heldout_prompts
    from specla.drafters import load_drafter
    from specla.tokenizer import load_raw

    ap = argparse.ArgumentParser(prog="python -m specla.train tree-preset", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="assets/drafters/block", help="a block drafter's folder (updated in place)")
    ap.add_argument("--target", default="assets/target")
    ap.add_argument("--corpus", default="data/corpus", help="folder written by `corpus` (its train split is read)")
    ap.add_argument("--prompts", type=int, default=48, help="training-split prompts the preset is chosen on")
    ap.add_argument("--heldout", default="data/corpus/heldout_prompts.jsonl",
                    help="held-out prompts (python -m specla.train prompts) the chosen preset is scored on; '' skips")
    ap.add_argument("--heldout-prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8, help="candidates per slot the table covers")
    ap.add_argument("--budget", type=int, default=15, help="draft nodes of the preset, the root not counted")
    ap.add_argument("--select", choices=("empirical", "table"), default="empirical",
                    help="empirical: the most frequent accepted paths (empirical_preset); table: the product "
                         "of per-slot rank chances (best_preset)")
    ap.add_argument("--steps", type=Path, help="a JSON file of recorded ranks: read if it exists, else written")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target, tokenizer, _ = load_model(args.target)
    drafter = load_drafter(args.drafter, target)
    if not getattr(drafter, "static_rows", False):
        raise SystemExit(f"{args.drafter}: a {drafter.kind} drafter's candidates depend on the path; "
                         "a measured preset is for the block drafter")
    slots = drafter.net.config.block_size - 1
    if args.steps is not None and args.steps.exists():
        recorded = json.loads(args.steps.read_text())
    else:
        raw = load_raw(Path(args.target).parent if (Path(args.target).parent / "tokenizer.json").exists() else "assets")
        train = [p["prompt"] for p in heldout_prompts(args.corpus, raw, n=args.prompts, seed=args.seed, split="train")]
        heldout = read_prompt_file(args.heldout, args.heldout_prompts) if args.heldout else []
        recorded = {"train": record_ranks(target, drafter, tokenizer, train, args.top_k, args.new_tokens),
                    "heldout": record_ranks(target, drafter, tokenizer, heldout, args.top_k, args.new_tokens),
                    "train_prompts": len(train), "heldout_prompts": len(heldout)}
        if args.steps is not None:
            args.steps.write_text(json.dumps(recorded))
    steps = recorded["train"]
    table = rank_acceptance(steps, slots, args.top_k)
    candidates = {"empirical": empirical_preset(steps, args.budget), "table": best_preset(table, args.budget),
                  "chain": [[0] * d for d in range(1, slots + 1)]}
    paths = candidates[args.select]

    def taus(split_steps: list[list[int]]) -> dict:
        return {name: round(measured_tau(split_steps, p), 4) for name, p in
                (("preset", paths), *((k, v) for k, v in candidates.items() if k != args.select))}

    preset = {"paths": paths, "selection": args.select, "rank_acceptance": [[round(p, 4) for p in row] for row in table],
              "measured_on": {"split": "train", "prompts": recorded["train_prompts"], "new_tokens": args.new_tokens,
                              "seed": args.seed, "steps": len(steps)},
              "tau": taus(steps),
              "command": "python -m specla.train tree-preset " + " ".join(argv or [])}
    if recorded["heldout"]:
        preset["heldout"] = {"file": args.heldout, "prompts": recorded["heldout_prompts"],
                             "steps": len(recorded["heldout"]), "tau": taus(recorded["heldout"])}
    config = Path(args.drafter) / "drafter.json"
    meta = json.loads(config.read_text())
    meta["tree_preset"] = preset
    config.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(paths)} nodes ({args.select}); tau on the training split {preset['tau']}"
          + (f", held out {preset['heldout']['tau']}" if "heldout" in preset else "") + f" -> {config}")


if __name__ == "__main__":
    main()
