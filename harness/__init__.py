"""gguf-harness: verification and benchmarking of GGUF LLM inference backends."""

__version__ = "0.1.0"
