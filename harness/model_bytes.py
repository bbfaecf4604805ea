"""Which tensors a decode step needs, and the bytes it reads (docs/sources.md §1: 'tensors
needed for decoding'). MTP blocks are excluded: the last `{arch}.nextn_predict_layers` blocks
of `block_count` (their attention and FFN tensors carry no 'nextn' in their names, only the
four nextn.* extras do), plus any tensor named *.nextn.*."""
from __future__ import annotations

import re

from .gguf_file import GGUFInfo, TensorInfo

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def mtp_blocks(info: GGUFInfo) -> range:
    """Block indices of the MTP (next-token prediction) layers; empty when the file has none."""
    n_next = int(info.get(f"{info.arch}.nextn_predict_layers", 0) or 0)
    n_all = int(info.get(f"{info.arch}.block_count", 0) or 0)
    return range(n_all - n_next, n_all) if 0 < n_next <= n_all else range(0)


def decode_tensors(info: GGUFInfo) -> dict[str, TensorInfo]:
    """The tensors a plain decode step uses (everything but the MTP blocks), by name."""
    mtp = mtp_blocks(info)

    def is_mtp(name: str) -> bool:
        m = _BLOCK.match(name)
        return ".nextn." in name or (m is not None and int(m.group(1)) in mtp)
    return {n: t for n, t in info.tensors.items() if not is_mtp(n)}


def decode_weight_bytes(info: GGUFInfo) -> int:
    """Bytes one decode step reads: every decode tensor once, token_embd one row (its whole
    table when the head is tied to it)."""
    tensors = decode_tensors(info)
    tied = "output.weight" not in tensors
    return sum((t.nbytes if tied else t.row_bytes) if n.startswith("token_embd.") else t.nbytes
               for n, t in tensors.items())
