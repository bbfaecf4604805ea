"""GGML types the engine's kernels read in place (type id -> name), and the checks a tensor
must pass before a node uses it. Block and byte sizes come from the oracle's registry
(oracles.dequant.FORMATS, which mirrors ggml-common.h), so there is one table of them."""
from __future__ import annotations

from harness.errors import UnsupportedError
from oracles.dequant import FORMATS

# The engine's GEMV/embedding kernels (kernels/dequant.cuh, iquants.cuh) implement exactly these ids.
ENGINE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16",
                16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M"}


def check_type(type_id: int, what: str) -> None:
    """UnsupportedError naming the tensor when the engine has no kernel for its type."""
    if type_id not in ENGINE_TYPES:
        name = FORMATS[type_id].name if type_id in FORMATS else f"type id {type_id}"
        raise UnsupportedError(f"{what}: GGML type {name} has no engine kernel (supported: "
                               f"{', '.join(ENGINE_TYPES.values())})")

