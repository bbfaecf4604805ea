"""Run any object in a child process, so that a crash (SIGSEGV, abort) is reported, not fatal.

`ChildProxy("pkg.module:Class", kwargs)` starts a fresh interpreter (`python -m
backends.proc_child`: no inherited threads or library state, like multiprocessing's "spawn"),
builds `Class(**kwargs)` there and forwards method calls over a multiprocessing Connection on
a socketpair; arguments and results are pickled (numpy arrays included). The child gets the
parent's sys.path, so any class importable in the parent can be the target.

Error mapping (parent side):
- the child raises a harness.errors.HarnessError subclass (ModelError, ...): the same class is
  raised in the parent with the child's message; the child keeps serving;
- the child raises anything else: BackendCrash naming the exception; the child keeps serving;
- the child dies (EOF on the pipe): BackendCrash naming the signal (e.g. SIGSEGV) or exit code
  and quoting the tail of the child's stdout+stderr (captured to a temporary file);
- no answer within the call's timeout: the child is killed, BackendCrash.
Every BackendCrash carries attributes `exitcode` (int | None), `signal` (str | None) and
`stderr_tail` (str); errors rebuilt from the child carry `child_traceback` (str).
A proxy whose child died raises BackendCrash on every later call; other proxies are unaffected.
"""
from __future__ import annotations

import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from harness.errors import BackendCrash, HarnessError

DEFAULT_CALL_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 120.0
STDERR_TAIL_BYTES = 4000
# what a line stating a child's cause of death looks like (libggml: "GGML_ASSERT(...) failed",
# llama.cpp: "error: ...", "... failed to ...")
_CAUSE = re.compile(r"GGML_ASSERT|\berror\b|\bfailed\b|\babort", re.IGNORECASE)
_EXIT_WAIT_S = 5.0  # how long a child that closed its pipe may take to exit
# The folder holding the `backends` package, so the child can import backends.proc_child.
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exit_description(exitcode: int | None) -> tuple[str, str | None]:
    """('signal SIGSEGV (exit code -11)', 'SIGSEGV') for a multiprocessing exit code.

    subprocess reports death by signal N as return code -N (Python docs, Popen.returncode).
    """
    if exitcode is None:
        return "no exit code (still running)", None
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"signal {name} (exit code {exitcode})", name
    return f"exit code {exitcode}", None


def _resolve_class(module: str, qualname: str) -> type | None:
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - any failure means "not rebuildable"
        return None
    return obj if isinstance(obj, type) else None


def _spawn(log_fd: int, label: str) -> tuple[Connection, subprocess.Popen]:
    """Start `python -m backends.proc_child FD`: a fresh interpreter (nothing inherited but
    the environment), talking over one end of a socketpair; stdout and stderr go to log_fd.

    Unlike multiprocessing's "spawn" start method this never re-imports the parent's
    __main__ script, so it also works from scripts without an `if __name__` guard.
    """
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PROJECT_ROOT, env.get("PYTHONPATH")]))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backends.proc_child", str(child_sock.fileno()), label],
            pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL, stdout=log_fd,
            stderr=log_fd, env=env, close_fds=True)
    finally:
        child_sock.close()  # the child holds its own copy; ours would hide its EOF
    return Connection(parent_sock.detach()), proc


def _wait_quietly(proc: subprocess.Popen) -> None:
    """Reap a child that closed its end; it may still be writing its crash report."""
    try:
        proc.wait(_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def _kill(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Give the child grace_s to exit on its own, then SIGKILL it and reap it."""
    try:
        proc.wait(grace_s)
        return
    except subprocess.TimeoutExpired:
        proc.kill()
    _wait_quietly(proc)


def _cleanup(proc: subprocess.Popen, conn: Connection, stderr_path: str) -> None:
    """Finaliser: never leave a child or a temp file behind, even without close()."""
    try:
        conn.close()
    except OSError:
        pass
    _kill(proc, grace_s=_EXIT_WAIT_S)  # a child told to exit closes its object first
    try:
        os.unlink(stderr_path)
    except OSError:
        pass


class ChildProxy:
    """Parent-side handle of an object living in a child process.

    target: "module:Class" import path, resolved in the child; kwargs: constructor arguments
    (picklable). call_timeout_s: default limit per call (seconds); start_timeout_s: limit for
    spawning and constructing. Raises what the constructor raised (see module docstring).
    Public attribute access on the proxy forwards method calls: `proxy.tokenize("hi")`.
    """

    def __init__(self, target: str, kwargs: dict | None = None, *,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 label: str | None = None) -> None:
        self.target = target
        self.label = label or target
        self.call_timeout_s = call_timeout_s
        self.dead_reason: str | None = None
        self._lock = threading.Lock()  # one request/answer pair on the pipe at a time
        fd, self.stderr_path = tempfile.mkstemp(prefix="proc-", suffix=".log")
        self._conn, self._proc = _spawn(fd, self.label)
        os.close(fd)
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._conn, self.stderr_path)
        try:
            self.child_info: dict = self._exchange(("init", target, (list(sys.path),), kwargs or {}),
                                                   "__init__", start_timeout_s)
        except BaseException:
            self._stop()
            raise

    # ---- public -------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None,
             timeout_s: float | None = None) -> Any:
        """Call `method(*args, **kwargs)` on the child's object; returns its (unpickled) result.

        Raises the child's HarnessError subclass, or BackendCrash (died, raised, timed out).
        """
        if self.dead_reason is not None:
            raise self._crash_error(f"{method}() called but the child is gone: {self.dead_reason}")
        return self._exchange(("call", method, args, kwargs or {}),
                              method, timeout_s or self.call_timeout_s)

    def getattr(self, attr: str, timeout_s: float | None = None) -> Any:
        """Value of a public attribute of the child's object."""
        if self.dead_reason is not None:
            raise self._crash_error(f"getattr {attr!r}: the child is gone: {self.dead_reason}")
        return self._exchange(("getattr", attr, (), {}), attr, timeout_s or self.call_timeout_s)

    def stderr_tail(self, n_bytes: int = STDERR_TAIL_BYTES) -> str:
        """Last n_bytes of what the child wrote to its stderr (fd 2), decoded leniently."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.stderr_path) - n_bytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the child to exit (it calls its object's close() first when there is one),
        then reap it; kills it if it does not exit in time. Idempotent; never raises."""
        if self.dead_reason is None and self._proc.poll() is None:
            try:
                self._exchange(("exit", "", (), {}), "exit", timeout_s)
            except HarnessError:
                pass
        self._stop()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, args, kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------
    def _stop(self) -> None:
        if self.dead_reason is None:
            self.dead_reason = "closed"
        self._finalizer()

    def _exchange(self, msg: tuple | None, what: str, timeout_s: float) -> Any:
        with self._lock:
            return self._exchange_locked(msg, what, timeout_s)

    def _exchange_locked(self, msg: tuple | None, what: str, timeout_s: float) -> Any:
        try:
            if msg is not None:
                self._conn.send(msg)
            if not self._conn.poll(timeout_s):
                _kill(self._proc)
                self.dead_reason = f"killed after no answer to {what}() within {timeout_s:g} s"
                raise self._crash_error(f"{what}() timed out after {timeout_s:g} s; child killed")
            reply = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            _wait_quietly(self._proc)
            desc, _ = exit_description(self._proc.poll())
            self.dead_reason = f"died with {desc}"
            raise self._crash_error(f"child process died during {what}() with {desc}") from None
        if reply[0] == "ok":
            return reply[1]
        raise self._child_error(what, *reply[1:])

    def stderr_cause(self, n_bytes: int = 1 << 20) -> str:
        """The child's last stderr line that states why it died (a GGML_ASSERT, an `error:` /
        `failed` / `abort` line), searched in its last n_bytes; "" if none. Why: an abort in
        libggml prints the assertion and then a debugger backtrace, which fills the
        STDERR_TAIL_BYTES tail and pushes the assertion out of it."""
        cause = ""
        for line in self.stderr_tail(n_bytes).splitlines():
            line = line.strip()
            if line.startswith("#") or not _CAUSE.search(line):  # "#3 0x... in f()": backtrace frames
                continue
            if "GGML_ASSERT" in line:  # the assertion itself beats whatever the debugger says after it
                return line[:500]
            cause = line
        return cause[:500]

    def _crash_error(self, text: str) -> BackendCrash:
        tail = self.stderr_tail()
        msg = f"{self.label}: {text}"
        if cause := self.stderr_cause():
            msg += f": {cause}"
        if tail.strip():
            msg += "\n--- child stderr (tail) ---\n" + tail.rstrip()
        exc = BackendCrash(msg)
        exc.exitcode = self._proc.poll()
        exc.signal = exit_description(exc.exitcode)[1]
        exc.stderr_tail = tail
        return exc

    def _child_error(self, what: str, module: str, qualname: str, text: str,
                     tb: str) -> Exception:
        cls = _resolve_class(module, qualname)
        if cls is not None and issubclass(cls, HarnessError):
            try:
                exc = cls(text)
            except Exception:  # noqa: BLE001 - a constructor with other arguments
                exc = BackendCrash(f"{self.label}: {what}() raised {qualname}: {text}")
        else:
            exc = BackendCrash(f"{self.label}: {what}() raised {module}.{qualname}: {text}")
        if isinstance(exc, BackendCrash):
            exc.exitcode, exc.signal, exc.stderr_tail = None, None, ""
        exc.child_traceback = tb
        return exc


class BackendProxy(ChildProxy):
    """A Backend (backends/base.py) whose object lives in a child process.

    Same methods and return values as the Backend protocol; extra methods of the backend
    (tokenize, model_info, ...) are forwarded by attribute access. close() ends the child.
    """

    def __init__(self, target: str, kwargs: dict | None = None, **opts: Any) -> None:
        super().__init__(target, kwargs, **opts)
        self.name: str = self.child_info.get("name") or target

    def load(self, model, cfg) -> None:
        self.call("load", (model, cfg))

    def reset(self) -> None:
        self.call("reset")

    def prefill(self, tokens):
        return self.call("prefill", ([int(t) for t in tokens],))

    def step(self, token: int):
        return self.call("step", (int(token),))

    def capabilities(self) -> set[str]:
        return set(self.call("capabilities"))

    def close(self) -> None:
        self.shutdown()
