"""Bytes a decode step must read from a GGUF model: every tensor of the layers and the
output head once, plus one row of token_embd (docs/sources.md §1: 'tensors needed for decoding').
Tied models read token_embd whole as the head. MTP layers (nextn) are excluded."""
from __future__ import annotations

from .gguf_file import GGUFInfo


def decode_weight_bytes(info: GGUFInfo) -> int:
    tied = "output.weight" not in info.tensors
    total = 0
    for name, t in info.tensors.items():
        if name.startswith("token_embd."):
            total += t.nbytes if tied else t.row_bytes
        elif ".nextn." not in name:
            total += t.nbytes
    return total
