"""The budget of a generation being written: how many bytes it may take, and the checks against it.

``Store.budget()`` fixes it when a writer opens (the store's budget less its committed
generations, capped by free space; free RAM for an in-RAM store); every shard writer
projects the generation's size from its first records and checks what it stored on every
put, and the commit checks the allocated size of the whole staging area.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BudgetExceededError
from .disk import format_size


@dataclass(frozen=True)
class Budget:
    """How many bytes a new generation may take, fixed when its writer opens."""

    available: int | None  # None: unlimited
    limit: int | None
    used: int
    where: str
    unit: str = "disk"

    def check_projection(self, generation: int, per_sample: float, num_samples: int) -> None:
        """Raise early when `num_samples` records of `per_sample` bytes would not fit."""
        needed = per_sample * num_samples
        if self.available is not None and needed > self.available:
            fits = int(self.available // per_sample) if per_sample else 0
            exc = BudgetExceededError(
                f"generation {generation} of {self.where} needs about {format_size(needed)} of {self.unit} "
                f"({num_samples} samples x {format_size(per_sample)}) but only {format_size(self.available)} "
                f"is available ({self._limit_text()}); about {fits} samples would fit"
            )
            exc.fits_samples = fits
            raise exc

    def check_usage(self, generation: int, written: int) -> None:
        """Raise when a generation already took more than the budget allows."""
        if self.available is not None and written > self.available:
            raise BudgetExceededError(
                f"generation {generation} of {self.where} grew to {format_size(written)} of {self.unit}, "
                f"over the {format_size(self.available)} available ({self._limit_text()}); "
                "its staging area is removed"
            )

    def _limit_text(self) -> str:
        if self.limit is None:
            return f"free {self.unit} space"
        return f"budget {format_size(self.limit)}, {format_size(self.used)} used by committed generations"
