"""Errors shown to users as one clear line (the CLI catches HarnessError; no traceback)."""


class HarnessError(Exception):
    """Base of every error the CLI reports as a message and a non-zero exit code."""

    exit_code = 2


class ModelError(HarnessError):
    """A model file is missing, truncated, malformed, or fails its checksum."""


class UnsupportedError(HarnessError):
    """An architecture, tensor type or option a backend does not implement."""


class ConfigError(HarnessError):
    """Invalid settings (empty prompt, n_predict <= 0, unknown backend, ...)."""


class BackendCrash(HarnessError):
    """A backend's child process died or raised; recorded in the result, not fatal to a run."""


class NumericError(HarnessError):
    """NaN or Inf in activations or logits; the message names the first node producing it."""
