"""`harness bench kernels`: per-kernel GEMV microbenchmark of the engine (GPU only; the row
and figure helpers run anywhere).

Per selected shape (harness.kernel_shapes.SHAPES, or --shapes / --formats):
1. a type the engine has no kernel for (backends.engine.formats.ENGINE_TYPES, read at run
   time) gives a row with status "unsupported";
2. kernel_case.GemvCase builds R copies (R x weight bytes >= --cold-bytes, 2 GB) and checks
   copy 0 against the float64 oracle (oracles.gemv_check; the output head's 248320 rows are
   checked on a random subset of rows, see kernel_shapes.check_rows); a failing kernel gets
   status "failed" and is not timed;
3. three modes, CUDA events behind a stream hold (harness.gpu_timing), the GEMV and the
   stream-read roofline over the same bytes (harness.roofline) each measured until the
   StopRule (harness.bench_stats) stops:
     cold_b2b     headline: one CUDA graph launching the R copies back to back (GEMVs with
                  PDL, as in a decode step; roofline reads plain); per kernel = graph / R
     cold_single  one launch of copy 0 after writing 2 x L2 of scratch (outside the events)
     hot          one graph launching copy 0 HOT_REPS times (weights in L2 where they fit)
Figures per mode: median, p20, p80 us; GB/s = (weights + x + output bytes) / time; % of the
copy bandwidth measured at the start of the run (harness.gpu.copy_bandwidth); % of roofline
= roofline time / kernel time (same bytes). With PDL on, GEMVs overlap their prologue with
the previous kernel's tail, which the plain roofline reads do not: small shapes can exceed
100 % of roofline in cold_b2b (GGUF_HARNESS_PDL=off for a like-for-like comparison).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from . import bench_stats as bs
from .errors import ConfigError, UnsupportedError
from .kernel_shapes import (
    CHECK_VALUES,
    COLD_BYTES,
    MAX_COPIES,
    Shape,
    copies_for,
    unsupported_reason,
)

SCHEMA = "gguf-harness/kernels/1"
MODES = ("cold_b2b", "cold_single", "hot")
HOT_REPS = 20


@dataclass(frozen=True)
class KernelsConfig:
    """Settings of one run; CLI flags map 1:1 (harness/bench_cmd.py). modes: subset of MODES;
    cold_bytes: weight bytes of one cold back-to-back graph; max_copies: its length cap;
    check_values: float64 oracle budget per shape (values); seed: blocks and x."""

    modes: tuple[str, ...] = MODES
    rule: bs.StopRule = field(default_factory=bs.StopRule)
    cold_bytes: int = COLD_BYTES
    max_copies: int = MAX_COPIES
    check_values: int = CHECK_VALUES
    seed: int = 0
    hot_reps: int = HOT_REPS

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"modes {list(self.modes)}: expected some of {', '.join(MODES)}")
        if self.cold_bytes < 1 or self.max_copies < 2 or self.check_values < 1 or self.hot_reps < 1:
            raise ConfigError("need cold bytes >= 1, max copies >= 2, check values >= 1, hot reps >= 1")

    def to_json(self) -> dict:
        return asdict(self)


def base_row(shape: Shape) -> dict:
    """The shape's part of a result row (no GPU needed)."""
    return {"name": shape.name, "spec": shape.spec, "label": shape.label(), "source": shape.source,
            "fmt": shape.fmt, "type_id": shape.type_id, "rows": shape.rows, "K": shape.K,
            "n_mats": shape.n_mats, "epilogue": shape.mode, "bytes": shape.bytes(),
            "status": "pending", "reason": None, "modes": {}}


def unsupported_row(shape: Shape, engine_types: dict[int, str]) -> dict | None:
    """A finished row with status "unsupported" when the engine lacks the type, else None."""
    why = unsupported_reason(shape, engine_types)
    return None if why is None else dict(base_row(shape), status="unsupported", reason=why)


def mode_figures(nbytes: int, kernel: dict, roof: dict, copy_gbs: float | None) -> dict:
    """One mode's figures from the kernel's and the roofline's summaries (bench_stats.summarize
    of the same byte count): {kernel, roofline, gb_s, roof_gb_s, pct_copy, pct_roofline}."""
    g, rg = bs.gb_s(nbytes, kernel["us"]), bs.gb_s(nbytes, roof["us"])
    return {"kernel": kernel, "roofline": roof, "gb_s": g, "roof_gb_s": rg,
            "pct_copy": bs.pct(g, copy_gbs), "pct_roofline": bs.pct(roof["us"], kernel["us"])}


def _measure(timer, rule: bs.StopRule, work, per: int, before=None) -> dict:
    with timer.stream:
        work()  # warm-up: the first replay uploads a graph, the first launch loads code
    samples, verdict = bs.collect(lambda: timer.time(work, before), rule)
    return bs.summarize(samples, verdict, per)


def _works(case, mode: str, hot_reps: int, flush):
    """(kernel work, roofline work, untimed prologue, launches per sample) of one mode."""
    from .gpu_timing import capture
    s = case.stream
    plain = [partial(r.launch, pdl_ok=False) for r in case.roof]
    if mode == "cold_b2b":
        g, r = capture(s, [n.launch for n in case.nodes]), capture(s, plain)
        return (lambda: g.launch(stream=s)), (lambda: r.launch(stream=s)), None, case.copies
    if mode == "hot":
        g, r = capture(s, [case.nodes[0].launch] * hot_reps), capture(s, plain[:1] * hot_reps)
        return (lambda: g.launch(stream=s)), (lambda: r.launch(stream=s)), None, hot_reps
    return partial(case.nodes[0].launch, pdl_ok=False), plain[0], flush, 1


def _time_case(case, cfg: KernelsConfig, timer, flush, copy_gbs, log) -> dict:
    out = {}
    for mode in cfg.modes:
        work, roof, before, per = _works(case, mode, cfg.hot_reps, flush)
        k = _measure(timer, cfg.rule, work, per, before)
        r = _measure(timer, cfg.rule, roof, per, before)
        out[mode] = mode_figures(case.shape.bytes()["total"], k, r, copy_gbs)
        log(f"  {mode}: {k['us']:.2f} us ({_num(out[mode]['gb_s'])} GB/s, "
            f"{_num(out[mode]['pct_roofline'])} % of roofline, noise {k['noise']:.3f}, {k['stop']})")
    return out


def _num(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _node_info(node) -> dict:
    return {"kernel": getattr(node.kernel, "name", ""), "grid": list(node.grid),
            "block": list(node.block), "smem": node.smem, "node_bytes": node.bytes}


def run_shape(shape: Shape, cfg: KernelsConfig, timer, flush, copy_gbs, log=print) -> dict:
    """One result row: "unsupported", "failed" (oracle check, not timed), "error" (an
    exception, recorded) or "ok" with the three modes' figures."""
    from backends.engine.formats import ENGINE_TYPES

    from .kernel_case import GemvCase
    row = unsupported_row(shape, ENGINE_TYPES)
    if row is not None:
        return row
    row, case = base_row(shape), None
    row["copies"] = copies_for(shape.n_mats * shape.matrix_bytes, cfg.cold_bytes, cfg.max_copies)
    row["cold_bytes"] = row["copies"] * shape.n_mats * shape.matrix_bytes
    try:
        case = GemvCase(shape, row["copies"], seed=cfg.seed, stream=timer.stream)
        row["node"] = _node_info(case.nodes[0])
        row["check"] = case.check(np.random.default_rng(cfg.seed + 1), cfg.check_values)
        row["roofline_check"] = case.check_roofline()
        if not (row["check"]["ok"] and row["roofline_check"]):
            return dict(row, status="failed", reason="oracle check failed: not timed"
                        if not row["check"]["ok"] else "roofline XOR mismatch: not timed")
        row["modes"] = _time_case(case, cfg, timer, flush, copy_gbs, log)
        row["same_after_timing"] = case.same_as_checked()
        ok = row["same_after_timing"]
        return dict(row, status="ok" if ok else "failed",
                    reason=None if ok else "output changed after the timed launches")
    except UnsupportedError as e:
        return dict(row, status="unsupported", reason=str(e))
    except Exception as e:  # one shape's CUDA/compile error must not end the run
        return dict(row, status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        if case is not None:
            case.close()


def run_kernels(shapes: list[Shape], cfg: KernelsConfig, log=print, advance=lambda: None,
                ggml: bool = False) -> dict:
    """Measure the device copy bandwidth, then every shape (run_shape). Returns the "kernels"
    part of the result: {schema, settings, device, rows}. Raises UnsupportedError without
    CuPy or a GPU. ggml: add llama.cpp's kernel per row (row["ggml"], settings["ggml"]:
    harness.bench_kernels_ggml)."""
    from backends.engine import launch, ops, switches

    from . import gpu, gpu_timing
    cp = gpu.require_cupy()
    copy = gpu.copy_bandwidth()
    log(f"copy bandwidth {copy['gb_s']:.0f} GB/s (read + write)")
    timer = gpu_timing.EventTimer(cp.cuda.Stream(non_blocking=True))
    flush = gpu_timing.L2Flush()
    device = {"l2_bytes": gpu_timing.l2_bytes(), "flush_bytes": flush.nbytes,
              "sm_count": int(cp.cuda.Device().attributes["MultiProcessorCount"]), "copy": copy}
    rows = []
    for shape in shapes:
        log(f"{shape.name} {shape.label()}")
        rows.append(run_shape(shape, cfg, timer, flush, copy["gb_s"], log))
        if rows[-1]["status"] != "ok":
            log(f"  {rows[-1]['status']}: {rows[-1]['reason']}")
        if ggml:
            from .bench_kernels_ggml import add_ggml
            add_ggml(rows[-1], shape, cfg, copy["gb_s"], log)
        advance()
    settings = dict(cfg.to_json(), shapes=[s.spec for s in shapes], gemv_impl=ops.GEMV_IMPL,
                    gemv_args=ops.GEMV_ARGS, gemv_kq=ops.GEMV_KQ, gemv_kq_split=ops.GEMV_KQ_SPLIT,
                    gemv_kq_unroll=ops.GEMV_KQ_UNROLL or "default",
                    gemv_kq2_unroll=ops.GEMV_KQ2_UNROLL or "default",
                    gemv_kq_minb=ops.GEMV_KQ_MINB or "default",
                    gemv_kq_pf=ops.GEMV_KQ_PF or "default", gemv_kq_pipe=ops.GEMV_KQ_PIPE or "default",
                    gemv_kq_l1pf=ops.GEMV_KQ_L1PF or "default",
                    gemv_kq_iq3s=ops.GEMV_KQ_IQ3S, gemv_kq_iq3s_grid=ops.GEMV_KQ_IQ3S_GRID or "default",
                    pdl=launch.pdl_available(), switches_effective=switches.effective())
    if ggml:
        from .bench_kernels_ggml import settings as ggml_settings
        settings["ggml"] = ggml_settings()
    return {"schema": SCHEMA, "settings": settings, "device": device, "rows": rows}
