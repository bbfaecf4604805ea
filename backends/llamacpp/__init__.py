"""llama.cpp backend package; import path for the registry: "backends.llamacpp:LlamaCppBackend"."""
from .backend import LlamaCppBackend, check_gguf_file

__all__ = ["LlamaCppBackend", "check_gguf_file"]
