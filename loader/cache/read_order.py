"""The order cached epochs read in, decided in one place: :func:`read_order`.

``cache_setting["read_order"]`` gives a generation's order: ``"random"`` (a full shuffle),
``"block"`` (blocks of consecutive records, shuffled, then shuffled within a window of blocks:
few large reads for a generation larger than memory) or ``"auto"``: random when the generation
fits the memory room, block otherwise (:func:`generation_order`). What the loader is asked for
overrides it: a sampler's order, no shuffle, ``nearby_shuffle``; and ranks that split one
order read in random order (each may read the generation, or the area being written).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import LoaderSettings

#: The block order's unit of reading: a block holds at least this many bytes of consecutive records.
BLOCK_BYTES = 1 << 20


def block_size(record_bytes: int) -> int:
    """Records per block: enough consecutive records for one read of at least :data:`BLOCK_BYTES`."""
    return max(1, -(-BLOCK_BYTES // max(1, record_bytes)))


@dataclass(frozen=True)
class ReadChoice:
    """How the read epochs of one generation go: ``order`` ``"random"`` or ``"block"`` (``block``
    records per block), and whether they read with explicit I/O (``stream``: it does not fit memory)."""

    order: str
    block: int
    stream: bool


def generation_order(setting: str, fits: bool) -> str:
    """A generation's order: `setting` (``read_order``), or for ``"auto"`` random when the
    generation `fits` the memory room and block otherwise."""
    if setting != "auto":
        return setting
    return "random" if fits else "block"


def read_order(choice: ReadChoice, settings: LoaderSettings, ranks: tuple[object, ...] | None, *,
               direct: bool = False, dealt: bool = False) -> str:
    """The order a read epoch serves in (see the module docstring): ``"block"`` or ``"random"`` (its
    generation's), ``"random"`` where `ranks` (the node's ranks, first) split one order or the whole
    cluster's samples are `dealt` to every rank, ``"block"`` where the epoch reads the remote
    `direct` ly (a block of consecutive records is one ranged read), or what overrides them all:
    ``"sampler"``, ``"sequential"`` (no shuffle), ``"nearby"`` (``nearby_shuffle``)."""
    if settings.sampling is not None:
        return "sampler"
    if not settings.shuffle:
        return "sequential"
    if settings.nearby_shuffle:
        return "nearby"
    if direct:
        return "block"
    if dealt or (ranks is not None and ranks[0] != 1):
        return "random"
    return choice.order
