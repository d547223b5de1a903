"""Money: a slice's GPU-hours at the GPU-hour price (the wasted price for wasted categories,
where one is configured) plus its energy at the energy price times PUE."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from costexporter.core.model import WASTED_CATEGORIES, Category

MS_PER_HOUR = 3_600_000.0
MJ_PER_KWH = 3_600_000_000.0  # millijoules in a kilowatt-hour
DEFAULT_PRICE_PER_GPU_HOUR = 3.5  # USD per B200/B300 GPU-hour (R7, docs/background.md)
MICRO_PER_UNIT = 1_000_000  # the ledger holds money in integer micro-units of its currency


def to_micro(amount: float) -> int:
    """A float amount of money in integer micro-units (nearest; for sums computed in floats)."""
    return round(float(amount) * MICRO_PER_UNIT)


def cost_per_valid_step(cost_micro: int, valid_steps: int) -> int | None:
    """A job's cost per valid step, in micro-units: its net cost (micro-units, as the ledger holds
    it) over its valid steps, rounded half-even to a micro-unit by integer arithmetic, so exact at
    any size. None without a valid step. The one rule: the API, the allocation rows, replay and
    the demo all call it, and the Prometheus recording rule is held to it."""
    if valid_steps <= 0:
        return None
    q, r = divmod(abs(cost_micro), valid_steps)
    if 2 * r > valid_steps or (2 * r == valid_steps and q & 1):
        q += 1
    return -q if cost_micro < 0 else q


@dataclass(frozen=True, slots=True)
class Prices:
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    wasted_price_per_gpu_hour: float | None = None  # R7's "base rate" for invalid time
    price_per_kwh: float | None = None
    pue: float = 1.0
    currency: str = "USD"

    def __post_init__(self) -> None:
        for name in ("price_per_gpu_hour", "wasted_price_per_gpu_hour", "price_per_kwh", "pue"):
            v = getattr(self, name)
            if v is not None and (not np.isfinite(v) or v < 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")

    def gpu_hour_rates(self) -> np.ndarray:
        """Price per GPU-hour for each category code."""
        base = self.price_per_gpu_hour
        wasted = base if self.wasted_price_per_gpu_hour is None else self.wasted_price_per_gpu_hour
        rates = np.full(len(Category), base, np.float64)
        rates[[int(c) for c in WASTED_CATEGORIES]] = wasted
        return rates

    def cost(
        self,
        gpu_ms: np.ndarray,
        energy_mj: np.ndarray,
        category: np.ndarray | None = None,
    ) -> npt.NDArray[np.float64]:
        """Cost of amounts given per category (category = arange) or per item with `category`,
        at these prices (a job's: `terms.job_terms` sets its own GPU-hour price)."""
        rates = self.gpu_hour_rates()
        rate = rates if category is None else rates[category]
        c: npt.NDArray[np.float64] = np.asarray(gpu_ms, np.float64) / MS_PER_HOUR * rate
        if self.price_per_kwh:
            c = c + np.asarray(energy_mj, np.float64) / MJ_PER_KWH * self.price_per_kwh * self.pue
        return c
