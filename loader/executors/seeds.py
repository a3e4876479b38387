"""The global random generators of a process that computes samples: seeded per worker, per batch.

torch seeds each worker's generators once, from ``(base seed, worker id)``
(:func:`seed_worker`). A dataset that draws random numbers in ``__getitem__``
and says its randomness is part of its state (torchdata's ``Stateful``:
``state_dict`` and ``load_state_dict``) has every batch's draws seeded from
``(seed, epoch, the batch's indices)`` instead (:func:`seeded_draws`): the
same whichever worker computes the batch, however many workers there are,
and after a resume (``docs/ARCHITECTURE.md``, "Resuming").
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import zlib
from typing import Iterator

import numpy as np

GLOBAL_RANDOM = threading.RLock()  # re-entered: a read_transform inside a batch whose draws are seeded


def seed_globals(sequence: np.random.SeedSequence) -> None:
    """Seed Python's and torch's global generators of this process from `sequence`."""
    state = _state(sequence)
    random.seed(state)
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator alone: torch.manual_seed also goes through every accelerator's
        # (lazily), which costs a hundred times more than seeding the CPU's.
        torch.default_generator.manual_seed(state & 0x7FFF_FFFF_FFFF_FFFF)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(state & 0x7FFF_FFFF_FFFF_FFFF)


def _state(sequence: np.random.SeedSequence) -> int:
    """The 64-bit seed of Python's generator drawn from `sequence` (torch's gets its low 63 bits)."""
    return int(sequence.generate_state(2, np.uint32).astype(np.uint64) @ np.array([1 << 32, 1], np.uint64))


def worker_seed(seed: int, worker_id: int) -> int:
    """The seed :func:`seed_worker` gives a worker's torch generator (torch's ``WorkerInfo.seed``)."""
    return _state(np.random.SeedSequence([seed, worker_id])) & 0x7FFF_FFFF_FFFF_FFFF


def seed_worker(seed: int, worker_id: int) -> None:
    """Seed a worker process's global generators from ``(seed, worker_id)``, as torch seeds its workers.

    Python's, numpy's legacy and torch's generators: workers forked from one
    process would otherwise draw the same random numbers in ``__getitem__``.
    Runs before ``worker_init_fn``, which may reseed them its own way.
    """
    sequence = np.random.SeedSequence([seed, worker_id])
    seed_globals(sequence)
    np.random.seed(sequence.generate_state(4))


def seed_torch_only(seed: int, worker_id: int) -> None:
    """Seed torch's generators as :func:`seed_worker` does, leaving Python's and numpy's as they are
    (torch imported after the worker's start, by its dataset or ``worker_init_fn``)."""
    python, legacy = random.getstate(), np.random.get_state()
    seed_worker(seed, worker_id)
    random.setstate(python)
    np.random.set_state(legacy)


def global_states() -> tuple[object, object, object]:
    """The states :func:`seed_globals` changes: Python's generator, torch's CPU one, CUDA's if initialised."""
    torch = sys.modules.get("torch")
    if torch is None:
        return random.getstate(), None, None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), torch.default_generator.get_state(), cuda


def restore_globals(saved: tuple[object, object, object]) -> None:
    python, cpu, cuda = saved
    random.setstate(python)  # type: ignore[arg-type]
    torch = sys.modules.get("torch")
    if torch is not None and cpu is not None:
        torch.default_generator.set_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def epoch_reseed(seed: int, epoch: int) -> int:
    """The seed a stream's workers reseed their generators from at the start of `epoch` (with their ids,
    :func:`seed_worker`): an epoch, resumed or served again, draws the same numbers in each worker."""
    return int(np.random.SeedSequence([seed % 2**63, epoch, 0x45]).generate_state(1)[0])


@contextlib.contextmanager
def seeded_draws(seed: int, epoch: int, indices: np.ndarray) -> Iterator[None]:
    """Python's, numpy's legacy and torch's global generators seeded from ``(seed, epoch, indices)`` while
    one batch is computed, their states given back afterwards: the training loop's draws (``nb_worker=0``,
    threads) stay its own, and a worker's next batch is seeded anew anyway."""
    sequence = np.random.SeedSequence([seed, epoch, zlib.crc32(np.ascontiguousarray(indices).tobytes()),
                                       len(indices)])
    with GLOBAL_RANDOM:
        saved, legacy = global_states(), np.random.get_state()
        seed_globals(sequence)
        np.random.seed(sequence.generate_state(4))
        try:
            yield
        finally:
            restore_globals(saved)
            np.random.set_state(legacy)
