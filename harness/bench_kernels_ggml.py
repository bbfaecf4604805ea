"""The optional llama.cpp column of `harness bench kernels --ggml` (harness.ggml_gemv).

Per shape, after the engine's row (harness.bench_kernels.run_shape), row["ggml"] holds:
  status            "ok"; "failed" (oracle check or output changed: not timed / not
                    trusted); "unavailable" (libggml, its CUDA backend or the type is
                    missing: the run goes on); "error" (an exception, recorded)
  reason            None or one line
  copies            R, the engine row's (same cold target), n_nodes: nodes of the graph
  backend           ggml's backend name ("CUDA0")
  check             oracles.ggml_gemv_check verdict (+ rows_total, unwritten, subset,
                    copies_agree)
  kernel            bench_stats.summarize of host-timed graph computes / R: us, us_p20,
                    us_p80, noise, n, stop
  gb_s, pct_copy    (weights + x + output bytes) / us, and % of the run's copy bandwidth
  same_after_timing copy 0's output after timing == the checked one, bit for bit
  engine_us         the engine's cold_b2b median us (None when not timed)
  engine_speedup    ggml us / engine us: > 1 means the engine's kernel is faster
The ggml column never changes the command's exit status (it is a reference, not a test
of the engine). Its time includes what ggml does per node besides the GEMV (x to q8_1,
gaps inside its CUDA graph): see harness/ggml_gemv.py and benchmarks/README.md.
"""
from __future__ import annotations

import numpy as np

from . import bench_stats as bs
from .errors import UnsupportedError
from .kernel_shapes import Shape, copies_for

ENGINE_MODE = "cold_b2b"  # the engine figure the ratio compares against (same R, same data)


def engine_us(engine_row: dict) -> float | None:
    """The engine's cold_b2b median us of a finished row, None unless status "ok"."""
    if engine_row.get("status") != "ok":
        return None
    us = (((engine_row.get("modes") or {}).get(ENGINE_MODE) or {}).get("kernel") or {}).get("us")
    return float(us) if us else None


def speedup(ggml_us: float | None, eng_us: float | None) -> float | None:
    """ggml us / engine us (> 1: the engine is faster); None when either is missing."""
    return ggml_us / eng_us if ggml_us and eng_us and eng_us > 0 else None


def ggml_row(shape: Shape, cfg, engine_row: dict, copy_gbs: float | None, log=print,
             backend: str = "cuda", path=None) -> dict:
    """The ggml column of one shape (module docstring). cfg: bench_kernels.KernelsConfig
    (seed, rule, check_values, cold_bytes, max_copies)."""
    from .ggml_gemv import GgmlGemv
    copies = engine_row.get("copies") or copies_for(shape.n_mats * shape.matrix_bytes,
                                                     cfg.cold_bytes, cfg.max_copies)
    eng = engine_us(engine_row)
    out = {"status": "pending", "reason": None, "copies": copies, "engine_us": eng,
           "engine_speedup": None}
    try:
        with GgmlGemv(shape, copies, seed=cfg.seed, backend=backend, path=path) as g:
            out.update(backend=g.backend_name, n_nodes=g.n_nodes)
            out["check"] = g.check(np.random.default_rng(cfg.seed + 1), cfg.check_values)
            if not out["check"]["ok"]:
                return dict(out, status="failed", reason="oracle check failed: not timed")
            k = g.time(cfg.rule)
            g_bs = bs.gb_s(shape.bytes()["total"], k["us"])
            out.update(kernel=k, gb_s=g_bs, pct_copy=bs.pct(g_bs, copy_gbs),
                       engine_speedup=speedup(k["us"], eng), same_after_timing=g.same_as_checked())
            ok = out["same_after_timing"]
            return dict(out, status="ok" if ok else "failed",
                        reason=None if ok else "output changed after the timed computes")
    except UnsupportedError as e:
        return dict(out, status="unavailable", reason=str(e))
    except Exception as e:  # one shape's ggml failure must not end the run
        return dict(out, status="error", reason=f"{type(e).__name__}: {e}")


def add_ggml(row: dict, shape: Shape, cfg, copy_gbs: float | None, log=print,
             backend: str = "cuda") -> dict:
    """row["ggml"] = ggml_row(...), with one log line; returns row."""
    row["ggml"] = g = ggml_row(shape, cfg, row, copy_gbs, log, backend)
    if g["status"] == "ok":
        x = g["engine_speedup"]
        log(f"  ggml: {g['kernel']['us']:.2f} us ({_num(g['gb_s'])} GB/s, check err/bound "
            f"{g['check']['max_err_over_bound']:.3f}"
            + (f", engine {x:.2f}x faster)" if x else ")"))
    else:
        log(f"  ggml {g['status']}: {g['reason']}")
    return row


def settings(backend: str = "cuda") -> dict:
    """The "ggml" entry of the run's settings: libraries loaded, or why not."""
    from .ggml_gemv import load
    try:
        lib = load(backend)
        return {"backend": backend, "available": True, "libs": lib.paths,
                "timing": "host wall time of ggml_backend_graph_compute / R"}
    except UnsupportedError as e:
        return {"backend": backend, "available": False, "reason": str(e)}


def _num(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


TABLE_COLUMNS = ("ggml us", "ggml GB/s", "ggml check", "engine x")


def table_cells(g: dict | None) -> list[str]:
    """Console cells for TABLE_COLUMNS: us, GB/s, check verdict (pass / FAIL / status),
    ggml us / engine us."""
    if not isinstance(g, dict):
        return ["-"] * 4
    chk = g.get("check") if isinstance(g.get("check"), dict) else None
    st = g.get("status", "-")
    verdict = "pass" if st == "ok" else ("FAIL" if chk and not chk.get("ok") else st)
    us = (g.get("kernel") or {}).get("us")
    return [_num(us, 2), _num(g.get("gb_s")), str(verdict), _num(g.get("engine_speedup"), 2)]
