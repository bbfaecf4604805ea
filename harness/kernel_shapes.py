"""The declared GEMV shapes of `harness bench kernels` and their arithmetic (CPU only).

Notation: "ROWSxK:FMT" is one matrix of ROWS output rows and input length K (GGUF ne =
[K, ROWS]) in GGML type FMT; "2xROWSxK:FMT" is a fused gate/up pair: one "swiglu" GEMV node
(backends/engine/ops.gemv) reading two such matrices and writing ROWS values
silu(gate x) * (up x).

SHAPES, source: the dense hybrid target of the source documents ("Qwen3.8-27B", llama.cpp
arch qwen35; docs/sources.md §1): hidden 5120, FFN 17408, vocab 248320, DeltaNet q/k/v
in-projection 2*16*128 + 48*128 = 10240 rows, DeltaNet inner width 48*128 = 6144, 4 KV
heads x 256 = 1024 rows; formats as in its UD-Q4_K_M file (Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S).
The two 4096-square rows are not from that model: a common 4096-wide projection shape
(e.g. a 7B-class model's attention matrices) in the two 32-value formats Q8_0 and Q4_0.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from oracles.dequant import FORMATS, get_format

from .errors import ConfigError

COLD_BYTES = 2_000_000_000  # weight bytes of one cold back-to-back graph (>> any L2)
MAX_COPIES = 1024            # graph length cap (a node costs ~1 us of GPU time in a graph)
CHECK_VALUES = 1 << 27       # float64 oracle budget per shape (1 GiB of dequantised rows)

# (name, spec, what it is in the source model)
SHAPES: tuple[tuple[str, str, str], ...] = (
    ("attn_qkv", "10240x5120:Q4_K", "DeltaNet q/k/v in-projection (2*16*128 + 48*128 rows)"),
    ("ffn_down", "5120x17408:Q5_K", "FFN down projection"),
    ("ffn_gate_up", "2x17408x5120:IQ4_XS", "FFN gate + up, fused SwiGLU node"),
    ("ssm_out", "5120x6144:Q6_K", "DeltaNet output projection (48*128 -> hidden)"),
    ("output", "248320x5120:Q6_K", "output head (vocab 248320)"),
    ("ffn_down_iq3", "5120x17408:IQ3_S", "FFN down projection, IQ3_S layers"),
    ("attn_k", "1024x5120:Q6_K", "attention K/V projection (4 KV heads x 256): tail wave"),
    ("ffn_down_q6", "5120x17408:Q6_K", "FFN down projection, Q6_K layers"),
    ("square_q8", "4096x4096:Q8_0", "generic 4096-square projection (not from the 27B)"),
    ("square_q4", "4096x4096:Q4_0", "generic 4096-square projection (not from the 27B)"),
)

_SPEC = re.compile(r"^(?:(2)x)?(\d+)x(\d+):([A-Za-z0-9_]+)$")
_BY_NAME = {f.name.upper(): t for t, f in FORMATS.items()}


@dataclass(frozen=True)
class Shape:
    """One benchmarked GEMV node: `n_mats` matrices (1, or 2 for a swiglu gate/up pair) of
    `rows` x `K` in GGML type `type_id`. Raises ConfigError on construction when K is not a
    whole number of the format's blocks or a size is < 1."""

    name: str
    spec: str
    rows: int
    K: int
    type_id: int
    n_mats: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        bs = get_format(self.type_id).block_size
        if self.rows < 1 or self.K < 1 or self.K % bs or self.n_mats not in (1, 2):
            raise ConfigError(f"shape {self.spec!r}: need rows, K >= 1, K a multiple of {bs} "
                              f"({self.fmt} blocks) and 1 or 2 matrices")

    @property
    def fmt(self) -> str:
        return FORMATS[self.type_id].name

    @property
    def mode(self) -> str:
        """ops.gemv epilogue: "swiglu" for a gate/up pair, else "store"."""
        return "swiglu" if self.n_mats == 2 else "store"

    @property
    def row_bytes(self) -> int:
        f = get_format(self.type_id)
        return self.K // f.block_size * f.type_size

    @property
    def matrix_bytes(self) -> int:
        return self.rows * self.row_bytes

    def bytes(self) -> dict:
        """Bytes one launch moves at the least: weights (every block read once), activation
        x (float32 [K], read once), output (float32 [rows], written once); "total" is
        their sum, the numerator of every GB/s figure."""
        w, act, out = self.n_mats * self.matrix_bytes, 4 * self.K, 4 * self.rows
        return {"weights": w, "act": act, "out": out, "total": w + act + out}

    def label(self) -> str:
        """"[rows x K] FMT" (with "2x" for a pair), for tables and plots."""
        return f"{'2x' if self.n_mats == 2 else ''}[{self.rows}x{self.K}] {self.fmt}"


# Bound on a spec's rows and K (the 27B's output head has 248320 rows): a typo such as an extra
# digit group is refused here rather than as a host allocation failure per shape on the GPU.
MAX_DIM = 1 << 20


def parse_spec(spec: str, name: str | None = None, source: str = "") -> Shape:
    """"[2x]ROWSxK:FMT" -> Shape (FMT a GGML type name, any case). Raises ConfigError."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ConfigError(f"shape {spec!r}: expected [2x]ROWSxK:FORMAT, e.g. 4096x4096:Q8_0")
    pair, rows, K, fmt = m.groups()
    if not 1 <= int(rows) <= MAX_DIM or not 1 <= int(K) <= MAX_DIM:
        raise ConfigError(f"shape {spec!r}: rows and K must be 1..{MAX_DIM:,}")
    type_id = _BY_NAME.get(fmt.upper())
    if type_id is None:
        raise ConfigError(f"shape {spec!r}: unknown GGML type {fmt!r}")
    return Shape(name or spec.strip(), spec.strip(), int(rows), int(K), type_id,
                 2 if pair else 1, source)


def table() -> list[Shape]:
    """SHAPES parsed, in declaration order."""
    return [parse_spec(spec, name, src) for name, spec, src in SHAPES]


def _split(csv: str | None) -> list[str]:
    return [s.strip() for s in (csv or "").split(",") if s.strip()]


def select(shapes_csv: str | None = None, formats_csv: str | None = None) -> list[Shape]:
    """The shapes to run. shapes_csv: comma list of table names or fnmatch patterns
    ("ffn_down*") and/or literal specs ("64x512:Q4_K", run as given); None/empty: the whole
    table. formats_csv: keep only shapes whose type name is listed (any case). Raises
    ConfigError for a name or pattern that matches nothing, an unknown format, or an empty
    selection."""
    base = table()
    picked: list[Shape] = []
    for tok in _split(shapes_csv) or ["*"]:
        if ":" in tok:
            if (sp := parse_spec(tok)) not in picked:  # a repeated spec would collide in `harness ab`
                picked.append(sp)
            continue
        hits = [s for s in base if fnmatch.fnmatchcase(s.name, tok)]
        if not hits:
            raise ConfigError(f"--shapes {tok!r} matches no shape (have: "
                              f"{', '.join(s.name for s in base)})")
        picked += [s for s in hits if s not in picked]
    fmts = {f.upper() for f in _split(formats_csv)}
    unknown = sorted(f for f in fmts if f not in _BY_NAME)
    if unknown:
        raise ConfigError(f"--formats: unknown GGML type(s) {', '.join(unknown)}")
    if fmts:
        picked = [s for s in picked if s.fmt.upper() in fmts]
    if not picked:
        raise ConfigError("no shape left after --shapes / --formats")
    return picked


def unsupported_reason(shape: Shape, engine_types: dict[int, str]) -> str | None:
    """Why the engine cannot run `shape` (its type id is not a key of engine_types, i.e.
    backends.engine.formats.ENGINE_TYPES read at run time), or None when it can."""
    if shape.type_id in engine_types:
        return None
    return f"the engine has no {shape.fmt} GEMV kernel (formats.ENGINE_TYPES)"


def copies_for(copy_bytes: int, target: int = COLD_BYTES, max_copies: int = MAX_COPIES) -> int:
    """R: distinct weight copies of one cold back-to-back graph, the least R with
    R * copy_bytes >= target, at least 2 (one launch never follows its own copy), at most
    max_copies (tiny shapes then stay below target: see the row's "cold_bytes").
    Raises ValueError for copy_bytes < 1."""
    if copy_bytes < 1:
        raise ValueError(f"copy_bytes must be >= 1, got {copy_bytes}")
    return max(2, min(max_copies, -(-target // copy_bytes)))


def check_rows(rows: int, K: int, rng, max_values: int = CHECK_VALUES) -> list[int]:
    """Rows the float64 oracle checks: all when rows * K <= max_values, else a sorted random
    subset of max_values // K rows (at least 2) that always holds the first and the last row
    (grid-stride ends). rng: numpy Generator."""
    n = max(2, max_values // K)
    if rows <= n:
        return list(range(rows))
    mid = rng.choice(range(1, rows - 1), size=n - 2, replace=False)
    return [0, *sorted(int(r) for r in mid), rows - 1]
