"""The standard verification prompt (docs/sources.md §3: a fixed 70-token prompt).

The text is natural, non-repeating prose: a prompt that repeats one sentence makes small
models copy it, and identical copied ids hide differences between backends (docs/sources.md §4,
"Lessons"). It is tokenised by the model's own tokenizer (through llama.cpp) and cut to
exactly STANDARD_PROMPT_TOKENS ids, so every backend sees the same ids.
"""
from __future__ import annotations

from .errors import ConfigError

STANDARD_PROMPT_TOKENS = 70
STANDARD_N_PREDICT = 129           # 1 token from the prefill logits + 128 timed decode steps
STANDARD_CONTEXTS = (512, 2048)

STANDARD_PROMPT = (
    "The lighthouse on the northern cape was built in 1874 from granite quarried two valleys "
    "inland. Its first keeper, a former ship's carpenter named Tobias Wren, kept a logbook in "
    "which he recorded the weather, passing vessels, and the migrating birds that struck the "
    "lantern glass on foggy autumn nights. Decades later, historians used his careful notes to "
    "reconstruct how storms along that coast had changed. Explain, step by step, what kinds of "
    "evidence such a logbook can provide, which of its measurements would be least reliable, "
    "and how a modern researcher should cross-check them against other sources."
)


def standard_prompt_ids(tokenize, n_tokens: int = STANDARD_PROMPT_TOKENS) -> list[int]:
    """Token ids of the standard prompt, cut to n_tokens.

    tokenize: callable(text) -> list[int] (the model's tokenizer, special tokens included as
    the model asks, e.g. BOS). Raises ConfigError if the text is shorter than n_tokens.
    """
    ids = list(tokenize(STANDARD_PROMPT))
    if len(ids) < n_tokens:
        raise ConfigError(f"the standard prompt gives only {len(ids)} tokens, need {n_tokens}")
    return ids[:n_tokens]
