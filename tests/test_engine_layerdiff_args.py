"""harness.engine_layerdiff refuses bad requests before touching a GPU (CPU test)."""
from __future__ import annotations

import pytest

from harness.errors import ConfigError, UnsupportedError


def test_empty_or_too_long_prompt_is_refused(tiny_qwen2_q):
    from harness.engine_layerdiff import engine_layer_diff
    with pytest.raises(ConfigError, match="prompt"):
        engine_layer_diff(tiny_qwen2_q, [], n_ctx=16)
    with pytest.raises(ConfigError, match="prompt"):
        engine_layer_diff(tiny_qwen2_q, list(range(17)), n_ctx=16)


def test_other_architectures_are_refused(tiny_qwen35_f32):
    from harness.engine_layerdiff import engine_layer_diff
    with pytest.raises(UnsupportedError, match="qwen2"):
        engine_layer_diff(tiny_qwen35_f32, [1, 2, 3], n_ctx=16)
