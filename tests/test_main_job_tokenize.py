"""harness.main_job.tokenize_prompt closes its tokenizer (a llama.cpp child process) when the
prompt is refused, and hands it over open when the prompt is accepted."""
from __future__ import annotations

import pytest

import backends.registry
from harness import main_job
from harness.errors import ConfigError


class FakeTokenizer:
    def __init__(self, ids):
        self.ids, self.closed = ids, False

    def load(self, model, cfg):
        pass

    def tokenize(self, text):
        return list(self.ids)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("ids,n_tokens", [([], None), ([1, 2, 3], 70)])
def test_refused_prompt_closes_the_tokenizer(monkeypatch, ids, n_tokens):
    fake = FakeTokenizer(ids)
    monkeypatch.setattr(backends.registry, "create", lambda name, in_child=False: fake)
    with pytest.raises(ConfigError):
        main_job.tokenize_prompt(None, "text", n_tokens)
    assert fake.closed


def test_accepted_prompt_keeps_the_tokenizer_open(monkeypatch):
    fake = FakeTokenizer(range(80))
    monkeypatch.setattr(backends.registry, "create", lambda name, in_child=False: fake)
    tok, ids = main_job.tokenize_prompt(None, "text", 70)
    assert tok is fake and not fake.closed and ids == list(range(70))
