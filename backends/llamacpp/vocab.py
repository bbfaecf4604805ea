"""Text <-> token ids through llama.cpp's tokenizer (llama.h: llama_tokenize,
llama_token_to_piece). Buffers grow to the size llama.cpp asks for (a negative return value
is minus the needed length)."""
from __future__ import annotations

import ctypes

import llama_cpp

from harness.errors import ConfigError

_MAX_TOKENS = 1 << 24   # refuse absurd inputs instead of allocating for them
_PIECE_BUF = 64


def tokenize(vocab, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
    """Token ids of `text` (UTF-8). add_special: BOS/EOS as the model's metadata asks;
    parse_special: treat "<|im_start|>"-like text as special tokens."""
    data = text.encode("utf-8")
    n_max = len(data) + 8   # a byte-level BPE never yields more tokens than bytes (+ specials)
    for _ in range(2):
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        n_max = -n
        if n_max > _MAX_TOKENS:
            break
    raise ConfigError(f"tokenizing {len(data)} bytes failed (llama_tokenize asked for {n_max})")


def piece(vocab, token: int, special: bool = True) -> bytes:
    """The raw bytes of one token (may be part of a UTF-8 character)."""
    size = _PIECE_BUF
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n
    raise ConfigError(f"token {token}: llama_token_to_piece failed")


def detokenize(vocab, ids, special: bool = True) -> str:
    """Concatenated pieces of `ids`, decoded as UTF-8 (invalid bytes replaced)."""
    return b"".join(piece(vocab, int(t), special) for t in ids).decode("utf-8", errors="replace")
