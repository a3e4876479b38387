"""`make demo`: an expensive dataset with and without the cache, epoch by epoch.

The dataset burns 5 ms of CPU per sample (think JPEG decoding plus
augmentation). Without a cache - torch's DataLoader - every epoch pays that
again. With CachedLoader, epochs 0 and 5 compute the samples (workers write
them into the store as they go) and the other epochs read them back.
"""

from __future__ import annotations

import logging
import shutil

from cachestore import open_store

from .common import table
from .expensive_dataset import cached_epochs, torch_epochs

N, COST, EPOCHS, K, WORKERS, BATCH = 1000, 0.005, 10, 5, 2, 64
DEMO_PREFIX = "cache/demo"  # kept after the run, so it can be inspected (ignored by git)


def _ratio(theirs: float, ours: float) -> str:
    speedup = theirs / ours if ours else float("inf")
    return f"{speedup:.1f}x" if speedup < 10 else f"{speedup:.0f}x"


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(__doc__.split("\n\n")[1].replace("\n", " "))
    print(f"\n{N} samples of 48 KiB, {COST * 1e3:.0f} ms CPU each, {EPOCHS} epochs, "
          f"update_frequency={K}, {WORKERS} workers, batch {BATCH}\n")
    prefix = DEMO_PREFIX
    shutil.rmtree(prefix, ignore_errors=True)  # every demo starts from an empty cache
    kwargs = {"n": N, "cost": COST}
    print("running CachedLoader (memmap store) ...", flush=True)
    ours, stats = cached_epochs(kwargs, EPOCHS, BATCH, WORKERS, K, prefix)
    print("running torch.utils.data.DataLoader ...", flush=True)
    theirs = torch_epochs(kwargs, EPOCHS, BATCH, WORKERS)
    rows = [[e, s.mode, f"{t:.2f}", f"{o:.2f}", _ratio(t, o)]
            for e, (s, o, t) in enumerate(zip(stats, ours, theirs))]
    rows.append(["total", "", f"{sum(theirs):.2f}", f"{sum(ours):.2f}", _ratio(sum(theirs), sum(ours))])
    print()
    print(table(["epoch", "cache", "without cache s", "with cache s", "speed-up"], rows))
    store = open_store(prefix, readonly=True)
    gens = [g for g in store.generations() if g.committed]
    print(f"\nthe cache: {prefix}/, {len(gens)} generation(s) kept, "
          f"{sum(g.nbytes for g in gens) / 2**20:.1f} MiB on disk. Look at it with "
          f"`.venv/bin/cachestore inspect {prefix}`; remove it with `rm -r {prefix}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
