"""Write the data section of a GGUF file with several worker processes (`harness synth --jobs`).

Every tensor's file offset is known before any data is made (the tensor infos hold them:
each offset is the previous one plus the previous tensor's size padded to general.alignment;
llama.cpp docs/gguf.md, gguf-py GGUFWriter.write_ti_data_to_file), so the caller
preallocates the <path>.part file (ftruncate: the padding reads back as zeros) and each
worker writes its chunks with os.pwrite at offset(tensor) + r0 * row_bytes.

Work units, submitted in file order:
  - one chunk (r0, r1) of a tensor whose rows(r0, r1) does not depend on earlier calls
    (TensorPlan.sequential False: qwen35 draws every 64-row group from its own stream);
  - a whole tensor otherwise (qwen2: one stream per tensor), made chunk after chunk in one
    worker.
Both call rows() with exactly the (r0, r1) of the single-process writer, so the file is the
same bytes. At most 2 units per worker are queued and a worker holds one chunk at a time:
RAM ~ jobs x one chunk (<= gguf_stream.CHUNK_BYTES of float64 temporaries + encoded rows).

Workers are started with the 'spawn' method (a fork would copy the parent's threads' locks,
e.g. the CLI's progress bar), so the row functions travel pickled (plans_blob), once per
worker. A caller running this from a script needs the usual `if __name__ == "__main__":`
guard (multiprocessing spawn re-imports the main module). Workers ignore SIGINT: Ctrl-C
reaches the parent, which cancels the queue and waits for the running chunks.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Sequence

from ..errors import ConfigError, HarnessError
from .gguf_stream import Progress, TensorPlan, encoded_chunk

QUEUE_PER_WORKER = 2

Unit = tuple[int, int, int, int]  # (plan index, row0, row1, file offset of row0)


class SynthWorkerError(HarnessError):
    """A worker process raised or died while making or writing a tensor chunk."""


def plans_blob(plans: Sequence[TensorPlan]) -> bytes:
    """The plans pickled for the workers; ConfigError when a row function is not picklable."""
    try:
        return pickle.dumps(list(plans), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ConfigError(f"jobs > 1 needs picklable row functions (module-level classes, "
                          f"not lambdas): {e}; use jobs=1") from None


def work_units(plans: Sequence[TensorPlan], offsets: Sequence[int]) -> list[Unit]:
    """(plan index, r0, r1, file offset) per unit, in file order (module doc)."""
    units: list[Unit] = []
    for i, (p, off) in enumerate(zip(plans, offsets)):
        spans = [(0, p.n_rows)] if p.sequential else p.chunks()
        units += [(i, r0, r1, off + r0 * p.row_bytes) for r0, r1 in spans]
    return units


_PLANS: list[TensorPlan] = []
_FD = -1


def _init(path: str, blob: bytes) -> None:
    global _PLANS, _FD
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _PLANS = pickle.loads(blob)
    _FD = os.open(path, os.O_WRONLY)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _run(i: int, r0: int, r1: int, offset: int) -> int:
    """Worker: make rows r0..r1-1 of plan i chunk by chunk, pwrite them; returns bytes."""
    plan, written = _PLANS[i], 0
    for a, b in plan.chunks(r0, r1):
        data = encoded_chunk(plan, a, b)
        _pwrite_all(_FD, memoryview(data.reshape(-1).view("u1")), offset + written)
        written += data.nbytes
    return written


def write_data(path: os.PathLike, blob: bytes, plans: Sequence[TensorPlan],
               offsets: Sequence[int], jobs: int, progress: Progress | None) -> None:
    """Write every tensor's rows into the preallocated file `path` with min(jobs, units)
    spawned workers; blob = plans_blob(plans), offsets = absolute file offset per tensor.
    Raises SynthWorkerError naming the tensor and rows when a worker raises or dies."""
    units = work_units(plans, offsets)
    total = sum(p.nbytes for p in plans)
    n_workers = max(1, min(jobs, len(units)))
    ctx = multiprocessing.get_context("spawn")
    ex = ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx,
                             initializer=_init, initargs=(os.fspath(path), blob))
    pending: dict = {}
    todo, done = iter(units), 0
    try:
        while True:
            while len(pending) < QUEUE_PER_WORKER * n_workers and (u := next(todo, None)):
                try:
                    pending[ex.submit(_run, *u)] = u
                except BrokenProcessPool as e:  # a worker died before this unit was queued
                    i, r0, r1, _ = next(iter(pending.values()), u)  # the oldest unfinished
                    raise _died(plans[i].name, r0, r1) from e
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                i, r0, r1, _ = pending.pop(fut)
                done += _result(fut, plans[i].name, r0, r1)
                if progress:
                    progress(done, total, plans[i].name)
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _died(name: str, r0: int, r1: int) -> SynthWorkerError:
    return SynthWorkerError(f"a synth worker process died (killed, or out of memory?) with "
                            f"chunks unfinished (first: tensor {name!r} rows {r0}:{r1}); no "
                            f"file was written")


def _result(fut, name: str, r0: int, r1: int) -> int:
    where = f"tensor {name!r} rows {r0}:{r1}"
    try:
        return fut.result()
    except BrokenProcessPool as e:
        raise _died(name, r0, r1) from e
    except Exception as e:
        raise SynthWorkerError(f"synth worker failed on {where}: {type(e).__name__}: {e} "
                               f"(no file was written; --jobs 1 runs it in one process "
                               f"with the full traceback)") from e
