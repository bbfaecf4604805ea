"""Capture llama.cpp / ggml log lines instead of printing them.

llama.cpp reports why a load or a context creation failed only through its log callback
(llama.h: llama_log_set; levels from ggml/include/ggml.h enum ggml_log_level). We keep the
last lines in memory so that errors can quote them.
"""
from __future__ import annotations

import collections
import ctypes

import llama_cpp

# ggml/include/ggml.h, enum ggml_log_level (this build: NONE 0, DEBUG 1, INFO 2, WARN 3,
# ERROR 4, CONT 5 = continuation of the previous line).
LEVEL_WARN = 3
LEVEL_ERROR = 4
LEVEL_CONT = 5

_MAX_LINES = 400


class LogCapture:
    """Process-wide sink for llama.cpp log messages (the callback is global in llama.cpp).

    lines: deque of (level, text) with continuation fragments merged into their line.
    """

    def __init__(self) -> None:
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=_MAX_LINES)
        # Keep a reference: llama.cpp stores the raw function pointer.
        self._callback = llama_cpp.llama_log_callback(self._on_log)

    def install(self) -> None:
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user_data) -> None:
        msg = text.decode("utf-8", errors="replace") if text else ""
        if level == LEVEL_CONT and self.lines:
            prev_level, prev = self.lines[-1]
            self.lines[-1] = (prev_level, prev + msg)
            return
        self.lines.append((level, msg))

    def problems(self, n: int = 6) -> list[str]:
        """The last n warning/error lines, stripped (most recent last)."""
        out = [text.strip() for level, text in self.lines
               if level in (LEVEL_WARN, LEVEL_ERROR) and text.strip()]
        return out[-n:]

    def clear(self) -> None:
        """Forget earlier lines (call before an operation whose errors you want to quote)."""
        self.lines.clear()


_CAPTURE: LogCapture | None = None


def capture() -> LogCapture:
    """The process-wide LogCapture, installed on first use."""
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = LogCapture()
        _CAPTURE.install()
    return _CAPTURE
