"""Training entry points: `python -m specla.train corpus|tokenizer|target|card|drafter ...`."""
