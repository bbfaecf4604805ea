"""The project's own CUDA engine: GEMV directly on GGUF blocks, a decode step as a node list,
eager or CUDA-graph execution. Needs CuPy and an NVIDIA GPU (extra `gpu`); importing this
package does not import CuPy."""
from .backend import EngineBackend

__all__ = ["EngineBackend"]
