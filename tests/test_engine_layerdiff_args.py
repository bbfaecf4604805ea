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


def test_other_architectures_are_refused(tmp_path):
    """qwen2 and qwen35 are mapped (test_engine_layerdiff_qwen35.py); a llama file is not."""
    import gguf

    from harness.engine_layerdiff import engine_layer_diff
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match="qwen2 and qwen35 nodes only, not llama"):
        engine_layer_diff(path, [1, 2, 3], n_ctx=16)


def test_inject_needs_the_qwen35_oracle(tiny_qwen2_q):
    from harness.engine_layerdiff import engine_layer_diff
    with pytest.raises(ConfigError, match="fault injection"):
        engine_layer_diff(tiny_qwen2_q, [1, 2, 3], n_ctx=16, inject={("l_out", 0): lambda a: a})
