"""The label that marks a token as no target: the losses ignore it (loongtrain/loss/sharded.py), the
post-training rows put it on prompts, padding and each document's last token (loongtrain/data/whole_packing.py)."""

IGNORE_INDEX = -100
