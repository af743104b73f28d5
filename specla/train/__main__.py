"""python -m specla.train <command> [args]: build the corpus, train the tokenizer, the target
model or a drafter, and write the model card. `<command> --help` lists each one's options."""
from __future__ import annotations

import importlib
import importlib.util
import sys

# command -> (module, function, what it does); a module is imported only when its command
# runs, and a command whose module is not there (yet) is not listed.
COMMANDS = {
    "corpus": ("specla.data", "main", "collect the Python source corpus (text + manifest)"),
    "tokenizer": ("specla.tokenizer", "main", "train the BPE tokenizer, write token files + prompts"),
    "prompts": ("specla.data", "prompts_main", "write the held-out and editing prompt sets (existing tokenizer)"),
    "target": ("specla.train.target", "main", "train the Gated DeltaNet target and export it"),
    "card": ("specla.train.target", "card_main", "write the model card from a training summary"),
    "drafter": ("specla.train.drafter", "main", "train a drafter for the target"),
    "tree-preset": ("specla.train.tree_preset", "main", "measure a block drafter's best fixed draft tree"),
}


def main(argv: list[str]) -> int:
    available = {name: spec for name, spec in COMMANDS.items()
                 if importlib.util.find_spec(spec[0]) is not None}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in available:
        print(__doc__)
        for name, (_, _, text) in available.items():
            print(f"  {name:<10} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module, function, _ = available[argv[0]]
    getattr(importlib.import_module(module), function)(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
