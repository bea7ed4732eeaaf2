"""Losses computed on sequence-sharded tokens without gathering logits (docs/memory.md).

- :mod:`loongtrain.loss.sharded`: cross-entropy of this rank's logits, mean over the replica's tokens.
- :mod:`loongtrain.loss.chunked`: the same loss from hidden states and the LM head weight, a chunk at a time.
"""
