"""Progress display for long work (rich progress bars on a terminal, plain lines otherwise)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress as RichProgress,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)


class Progress:
    """Context manager; `task(label, total)` returns a callable that advances by one."""

    def __init__(self, console: Console | None = None, enabled: bool = True):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._rich: RichProgress | None = None

    @classmethod
    def quiet(cls) -> "Progress":
        return cls(Console(stderr=True, quiet=True), enabled=False)

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._rich = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
                transient=False)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def task(self, label: str, total: int) -> Callable[[], None]:
        if self._rich is None:
            return lambda: None
        if not self.console.is_terminal:
            return self._plain(label, total)
        tid = self._rich.add_task(label, total=total)
        return lambda: self._rich.advance(tid)

    def _plain(self, label: str, total: int) -> Callable[[], None]:
        """Off a terminal (CI logs, pipes) live bars only appear at the end: print a line
        at every 10 % instead."""
        done = [0]
        step = max(1, total // 10)

        def advance() -> None:
            done[0] += 1
            if done[0] % step == 0 or done[0] == total:
                self.console.print(f"{label}: {done[0]}/{total}", markup=False, highlight=False)
        return advance

    def log(self, msg: str) -> None:
        self.console.print(msg, soft_wrap=True)


@contextmanager
def bytes_progress(console: Console, label: str):
    """Context giving a callback(n_bytes) that advances a transient byte-count bar (total
    unknown up front: assembling or hashing a model)."""
    if not console.is_terminal:  # a transient bar shows nothing there but leaves an empty line
        yield lambda n: None
        return
    bar = RichProgress(TextColumn(label), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                       console=console, transient=True)
    tid = bar.add_task(label, total=None)
    with bar:
        yield lambda n: bar.advance(tid, n)
