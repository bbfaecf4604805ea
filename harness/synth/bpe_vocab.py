"""A small, deterministic GPT-2-style byte-level BPE vocabulary for synthetic models.

Layout (mirrors the Qwen2.5 GGUF files): ids 0..255 are the 256 byte tokens in GPT-2's
byte-to-unicode order, then tokens made by BPE merges learnt from a fixed built-in corpus,
then the special tokens, then "[PAD<id>]" filler tokens up to n_vocab.
Token types are llama.cpp's LLAMA_TOKEN_TYPE_* (llama.cpp include/llama.h): 1 NORMAL,
3 CONTROL, 5 UNUSED. llama.cpp needs tokenizer.ggml.merges for a "gpt2" vocabulary and unique
token strings (src/llama-vocab.cpp, llama_vocab::impl::load); every byte has a token, so any
text tokenizes.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ..errors import ConfigError

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Written for this project; only its byte pairs matter.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A benchmark that is not checked against a
reference is only a number; a reference that is never compared with the engine is only a
hope. We measure the time of every kernel, then we compare the logits of every backend with
the float64 oracle, and we write the result into a report with the model hash and the
settings that produced it. The weights stay in their block formats on the device, and the
decode step is replayed as one graph. When a test fails, the report names the tensor, the
layer and the worst index, so the person who reads it knows where to look first.
def forward(tokens, weights):
    hidden = weights.token_embd[tokens]
    for layer in weights.layers:
        hidden = hidden + attention(rms_norm(hidden, layer.attn_norm), layer)
        hidden = hidden + feed_forward(rms_norm(hidden, layer.ffn_norm), layer)
    return rms_norm(hidden, weights.output_norm) @ weights.output.T
for i in range(10): print(i, i * i, "the", "then", "there", "these", "this", "that")
Numbers such as 2048, 4096, 151936 and 0.001 appear in tables of results.
"""

# GPT-2's pre-tokenizer pattern without the \p{} classes (re has none): words keep their
# leading space; used only to learn merges, llama.cpp applies its own "qwen2" pattern.
_PRETOKEN = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in its canonical order.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to chr(256 + n) in
    increasing byte order (openai/gpt-2 src/encoder.py, bytes_to_unicode).
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return {b: mapping[b] for b in keep + [b for b in range(256) if b not in keep]}


def _words(text: str, byte_map: dict[int, str]) -> Counter:
    return Counter(tuple(byte_map[b] for b in w.encode("utf-8"))
                   for w in _PRETOKEN.findall(text))


def _best_pair(words: Counter) -> tuple[tuple[str, str], int]:
    pairs: Counter = Counter()
    for w, n in words.items():
        for pair in zip(w, w[1:]):
            pairs[pair] += n
    if not pairs:
        return ("", ""), 0
    # highest count, ties broken by the pair's text, so the result never depends on order
    pair = min(pairs, key=lambda p: (-pairs[p], p))
    return pair, pairs[pair]


def _merge(words: Counter, pair: tuple[str, str]) -> Counter:
    out: Counter = Counter()
    a, b = pair
    for w, n in words.items():
        merged, i = [], 0
        while i < len(w):
            if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(w[i])
                i += 1
        out[tuple(merged)] += n
    return out


def learn_merges(max_merges: int, text: str = CORPUS) -> list[tuple[str, str]]:
    """Greedy BPE (Sennrich et al. 2016) on text: up to max_merges pairs seen twice or more."""
    words = _words(text, bytes_to_unicode())
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pair, count = _best_pair(words)
        if count < 2:
            break
        merges.append(pair)
        words = _merge(words, pair)
    return merges


@dataclass(frozen=True)
class Vocab:
    """tokens/token_types: n_vocab entries; merges: "left right" strings in rank order."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int


def build_vocab(n_vocab: int, max_merges: int = 1024) -> Vocab:
    """Byte tokens, learnt merges, specials, then [PAD<id>] fillers; exactly n_vocab tokens.

    Raises ConfigError when n_vocab cannot hold the 256 bytes, 3 specials and one merge.
    """
    n_min = 256 + len(SPECIAL_TOKENS) + 1
    if n_vocab < n_min:
        raise ConfigError(f"n_vocab must be >= {n_min} (256 byte tokens, "
                          f"{len(SPECIAL_TOKENS)} specials, 1 merge), got {n_vocab}")
    tokens = list(bytes_to_unicode().values())
    seen = set(tokens)
    room = n_vocab - len(tokens) - len(SPECIAL_TOKENS)
    merges = []
    for a, b in learn_merges(min(room, max_merges)):
        merges.append(f"{a} {b}")
        if a + b not in seen:  # two merges can spell the same token
            seen.add(a + b)
            tokens.append(a + b)
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [TOKEN_UNUSED] * (n_vocab - len(types))
    return Vocab(tokens, types, merges, bos_id=first_special, eos_id=first_special + 2,
                 pad_id=first_special)


def add_vocab(w, n_vocab: int, pre: str) -> None:
    """Write the tokenizer metadata of a gpt2 byte-level BPE vocab of n_vocab tokens into a
    gguf.GGUFWriter (keys of llama.cpp src/llama-vocab.cpp; `pre` names the pre-tokenizer)."""
    v = build_vocab(n_vocab)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", v.tokens)
    w.add_array("tokenizer.ggml.token_type", v.token_types)
    w.add_array("tokenizer.ggml.merges", v.merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", v.bos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", v.eos_id)
    w.add_uint32("tokenizer.ggml.padding_token_id", v.pad_id)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
