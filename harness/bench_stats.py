"""Sample statistics and the stopping rule of `harness bench kernels` (CPU only).

A measurement draws samples (seconds of GPU time, one per timed launch or graph replay) until
the StopRule says so, in the spirit of nvbench's: at least `min_samples` samples and
`min_time_s` of measured time, then stop as soon as the relative noise
(p80 - p20) / median is <= `max_noise`; stop anyway after `max_time_s` of wall-clock time
(verdict "capped": the noise target was not reached) or `max_samples` samples.
Percentiles: numpy's default linear interpolation.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from .errors import ConfigError

CONVERGED, CAPPED = "converged", "capped"


@dataclass(frozen=True)
class StopRule:
    """min_samples: samples before any stop; min_time_s: measured (GPU) seconds summed over
    the samples before a converged stop; max_noise: (p80 - p20) / median to stop at;
    max_time_s: wall-clock cap of one measurement; max_samples: sample cap."""

    min_samples: int = 10
    min_time_s: float = 0.05
    max_noise: float = 0.03
    max_time_s: float = 3.0
    max_samples: int = 100_000

    def __post_init__(self) -> None:
        if not (1 <= self.min_samples <= self.max_samples):
            raise ConfigError(f"need 1 <= min samples <= {self.max_samples}, got {self.min_samples}")
        finite = np.isfinite([self.min_time_s, self.max_noise, self.max_time_s]).all()
        if not finite or self.min_time_s < 0 or self.max_noise <= 0 or self.max_time_s <= 0:
            raise ConfigError(f"need finite --min-time >= 0, --max-noise > 0 and --max-time > 0; "
                              f"got {self.min_time_s:g}, {self.max_noise:g} and "
                              f"{self.max_time_s:g}")

    def verdict(self, samples: list[float], wall_s: float) -> str | None:
        """CONVERGED, CAPPED, or None to draw another sample."""
        n = len(samples)
        if n >= self.max_samples or (wall_s >= self.max_time_s and n >= 1):
            return CAPPED if n < self.min_samples or noise(samples) > self.max_noise else CONVERGED
        if n < self.min_samples or sum(samples) < self.min_time_s:
            return None
        return CONVERGED if noise(samples) <= self.max_noise else None

    def to_json(self) -> dict:
        return asdict(self)


def noise(samples: list[float]) -> float:
    """(p80 - p20) / median; inf for an empty list or a median <= 0."""
    if not samples:
        return float("inf")
    p20, med, p80 = np.percentile(samples, [20, 50, 80])
    return float((p80 - p20) / med) if med > 0 else float("inf")


def collect(sample: Callable[[], float], rule: StopRule,
            clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], str]:
    """Call sample() (returns seconds) until rule.verdict stops; (samples, verdict)."""
    t0, samples = clock(), []
    while True:
        samples.append(float(sample()))
        v = rule.verdict(samples, clock() - t0)
        if v is not None:
            return samples, v


def summarize(samples: list[float], verdict: str, per: int = 1) -> dict:
    """Microsecond figures of one measurement; each sample covered `per` launches (a graph of
    R kernels: per = R). Returns {us (median), us_p20, us_p80, noise, n, stop}. Raises
    ValueError on no samples or per < 1."""
    if not samples or per < 1:
        raise ValueError("summarize needs samples and per >= 1")
    p20, med, p80 = (1e6 * v / per for v in np.percentile(samples, [20, 50, 80]))
    return {"us": med, "us_p20": p20, "us_p80": p80, "noise": noise(samples), "n": len(samples),
            "stop": verdict}


def gb_s(nbytes: int, us: float) -> float | None:
    """Effective bandwidth in GB/s (1e9 bytes per second) of nbytes in us microseconds;
    None when us is not > 0."""
    return nbytes / us / 1e3 if us and us > 0 else None


def pct(part: float | None, whole: float | None) -> float | None:
    """100 * part / whole, None when either is missing or whole is not > 0."""
    return 100.0 * part / whole if part is not None and whole is not None and whole > 0 else None
