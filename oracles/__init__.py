"""Float64 numpy reference (oracle): dequantisation via gguf-py, cross-checked against libggml."""
