"""Child side of backends.proc: build the object, then serve calls from the parent.

Run as `python -m backends.proc_child FD LABEL`; FD is this end of a socketpair, stdout and
stderr already point at the parent's capture file.
Messages from the parent: (op, name, args, kwargs) with op "init" (first message only: name =
"module:Class", args = (parent's sys.path,)), "call", "getattr" or "exit".
Replies: ("ok", value) or ("err", module, qualname, message, traceback_text).
The reply to "init" is ("ok", {"name": obj.name or None, "pid": pid}).
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


def resolve(target: str) -> Any:
    """The object named by "package.module:attr.sub"; ImportError/AttributeError if absent."""
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"target must look like 'package.module:Class', got {target!r}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _error_reply(exc: BaseException) -> tuple:
    cls = type(exc)
    text = str(exc) if str(exc) else repr(exc)
    tb = "".join(traceback.format_exception(exc))
    return ("err", cls.__module__, cls.__qualname__, text, tb)


def _send(conn, reply: tuple) -> None:
    try:
        conn.send(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
        conn.send(_error_reply(exc))


def _handle(obj: Any, op: str, name: str, args: tuple, kwargs: dict) -> Any:
    if name.startswith("_"):
        raise AttributeError(f"private attribute {name!r} is not served")
    value = getattr(obj, name)
    if op == "getattr":
        return value
    return value(*args, **kwargs)


def _close_object(obj: Any) -> tuple:
    close = getattr(obj, "close", None)
    try:
        if callable(close):
            close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return _error_reply(exc)
    return ("ok", None)


def serve(conn, obj: Any) -> None:
    """Answer requests until "exit" or until the parent goes away (EOF)."""
    while True:
        try:
            op, name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            _close_object(obj)
            return
        if op == "exit":
            _send(conn, _close_object(obj))
            return
        try:
            reply = ("ok", _handle(obj, op, name, args, kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            reply = _error_reply(exc)
        _send(conn, reply)


def _construct(conn) -> Any:
    """Handle the "init" message; None when construction failed (already reported)."""
    op, target, (sys_path,), kwargs = conn.recv()
    if op != "init":
        raise RuntimeError(f"first message must be 'init', got {op!r}")
    sys.path[:] = list(dict.fromkeys(list(sys_path) + sys.path))
    try:
        obj = resolve(target)(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the parent re-raises it
        _send(conn, _error_reply(exc))
        return None
    _send(conn, ("ok", {"name": getattr(obj, "name", None), "pid": os.getpid()}))
    return obj


def main(argv: list[str]) -> int:
    """Entry point: argv = [FD, LABEL]."""
    faulthandler.enable(file=sys.stderr, all_threads=True)  # Python stack on SIGSEGV/SIGABRT
    conn = Connection(int(argv[0]))
    try:
        obj = _construct(conn)
    except (EOFError, OSError):
        return 1
    if obj is not None:
        serve(conn, obj)
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
