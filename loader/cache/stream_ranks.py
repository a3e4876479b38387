"""The ranks of a node writing their streams into one generation (``docs/ARCHITECTURE.md``, "Streams").

Under torchrun each rank iterates its own stream (split by rank inside ``__iter__``, as torch users
do); the node's store gets one generation of all of them, whose length nobody knows in advance:

* **Indices.** The ranks take turns by blocks of :data:`BLOCK` samples: rank ``r`` of ``R`` puts its
  ``k``-th sample at index ``(k // B) * R * B + r * B + k % B`` (:func:`interleaved`). The index a
  sample gets depends on the streams alone, never on which rank ran ahead. Blocks, not single
  samples: the commit cuts a column file's tail past the generation's end, and cutting a tail
  whose rows alternate with holes (the shorter streams' places) frees one extent per row, which
  took seconds for a few thousand rows of 4 KiB once they were on disk; a block is one extent.
* **The end.** At the end of its stream each rank says how many samples it wrote; the generation
  holds their sum ``N``. Where the streams were uneven, the longer ones' last samples lie at ``N``
  or past it and the shorter ones left as many holes below it: each rank moves its own samples
  past the end into the holes, both in ascending order (:func:`moves`), reading them back from the
  staging area and forgetting its shard's tail. Then local rank 0, which holds the store's writer
  lock, commits, and says so; the others end their epoch only then, so that every rank's next
  ``iter()`` finds the generation.
* **Rendezvous** (:class:`NodeStream`). The ranks talk through small JSON files in a directory of
  the store named after torchrun's run id, its restart count, the generation and the epoch (a new
  run never reads an old answer): local rank 0's ticket (the staging area every rank writes into),
  each rank's pid, its count, its moves done, the commit. A rank that fails (its stream raised)
  writes its error there first, and every other rank raises :class:`~loader.errors.RankFailedError`
  with it at its next look (after each batch, and while it waits): no rank waits for an answer that
  will never come. A rank whose loop broke off the epoch says so; the others serve the rest of their
  streams and end the epoch without a commit (:class:`Abandoned`). A rank whose process is gone without
  an answer, or that does not show up within :data:`JOIN_TIMEOUT`, is an error too. A rank that
  lives is waited for as long as it takes: its stream may be longer, or its training loop slower,
  and its own ``timeout`` bounds each of its batches (a stream that hangs fails that rank, which
  says so).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from cachestore import Store
from cachestore.backends.base import ShardWriter, StagingToken
from cachestore.backends.staging import parse_staging
from cachestore.errors import CacheStoreError
from cachestore.format.codec import Sample
from cachestore.guard.safefs import is_real_dir, write_json_atomic
from cachestore.guard.trust import OWN
from cachestore.guard.untrusted import is_file_name, read_document
from cachestore.space.scratch import pid_alive
from cachestore.write.writer import ShardSpec

from ..distributed import RANK_FILE_BYTES, check_rendezvous
from ..errors import RankFailedError, RanksTimeoutError

#: Seconds a rank waits for another to show up at all (it may still be starting its workers).
JOIN_TIMEOUT = 300.0
#: Longest pause between two looks at the rendezvous (processes of one job: no event to wait on).
MAX_POLL = 0.05
#: Seconds between two looks for another rank's error while this one iterates its stream.
CHECK_EVERY = 0.05
#: Seconds after which a rendezvous none of whose ranks lives is debris (a younger one may be starting).
STALE_AFTER = 60.0
#: Samples a rank puts in a row before the next rank's turn (see the module docstring).
BLOCK = 1024


def interleaved(k: int, rank: int, ranks: int, block: int = BLOCK) -> int:
    """The index of rank `rank`'s `k`-th sample (of `ranks` ranks taking turns by `block` samples)."""
    return (k // block) * ranks * block + rank * block + k % block


def moves(counts: Sequence[int], block: int = BLOCK) -> list[list[tuple[int, int]]]:
    """Per rank, ``(index written, index it moves to)`` of each of its samples at or past the
    generation's end (``sum(counts)``), paired in ascending order with the holes below the end that
    the shorter streams left (as many: the generation holds every index below the end once).

    A rank's indices grow with its arrivals: what it moves is the tail of what it wrote."""
    ranks, total = len(counts), sum(counts)
    over: list[tuple[int, int]] = []
    holes: list[int] = []
    for r, count in enumerate(counts):
        k = count - 1
        while k >= 0 and (index := interleaved(k, r, ranks, block)) >= total:
            over.append((index, r))
            k -= 1
        k = count
        while (index := interleaved(k, r, ranks, block)) < total:
            holes.append(index)
            k += 1
    out: list[list[tuple[int, int]]] = [[] for _ in counts]
    for (old, r), new in zip(sorted(over), sorted(holes)):
        out[r].append((old, new))
    return out


class Abandoned(RankFailedError):
    """A rank's training loop broke off the generate epoch (a step limit, a checkpoint and stop): the
    generation cannot be committed, and the other ranks end their epoch without it, as one rank alone
    would have kept what it wrote; the next epoch writes it again."""


def sweep_stale(store_path: str, keep: Path) -> None:
    """Remove the rendezvous left in `store_path` by runs whose ranks were killed: older than
    :data:`STALE_AFTER`, none of their ranks alive (every other one is a live run's, or one starting)."""
    try:
        found = [p for p in Path(store_path).iterdir() if p.name.startswith(".stream-") and p != keep]
    except OSError:
        return
    for where in found:
        try:
            if time.time() - where.lstat().st_mtime < STALE_AFTER or not is_real_dir(where):
                continue
            pids = [read_document(p, "a rank's file", RANK_FILE_BYTES, OWN).get("pid")
                    for p in where.glob("pid-*.json")]
        except (OSError, ValueError, AttributeError):
            continue  # removed meanwhile, or not ours to judge
        if not any(isinstance(pid, int) and pid_alive(pid) for pid in pids):
            shutil.rmtree(where, ignore_errors=True)


class NodeStream:
    """This rank's side of the rendezvous of one generation written by the node's ranks (see the
    module docstring).

    Parameters
    ----------
    store_path
        The node's store (the rendezvous is a directory in it).
    generation, epoch
        What the ranks write, and in which epoch.
    ranks, rank
        The node's ranks, and which one this is (local rank 0 holds the writer lock).
    """

    def __init__(self, store_path: str, generation: int, epoch: int, ranks: int, rank: int) -> None:
        env = os.environ
        key = (f"{env.get('TORCHELASTIC_RUN_ID')}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}-"
               f"{generation}-{epoch}")
        self.where = Path(store_path) / f".stream-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        self.generation, self.ranks, self.rank = generation, ranks, rank
        self._looked = 0.0
        if rank == 0:
            sweep_stale(store_path, keep=self.where)
        self.where.mkdir(exist_ok=True)
        check_rendezvous(self.where)  # this user's own, not a co-tenant's put in its place
        self.post("pid", {"pid": os.getpid()})

    # ------------------------------------------------------------------ the files
    def post(self, what: str, doc: dict[str, Any]) -> None:
        """Say `what` (`doc`) to the other ranks."""
        write_json_atomic(self.where / f"{what}-{self.rank}.json", doc)

    def _read(self, what: str, rank: int) -> dict[str, Any] | None:
        """Rank `rank`'s `what`, ``None`` while there is none (each file is written whole, renamed in)."""
        try:
            doc = read_document(self.where / f"{what}-{rank}.json", "a rank's file", RANK_FILE_BYTES, OWN)
        except FileNotFoundError:
            return None
        if not isinstance(doc, dict):
            raise RankFailedError(f"{self.where}/{what}-{rank}.json is not what a rank writes: {doc!r}")
        return doc

    def check(self, now: bool = False) -> int | None:
        """Raise another rank's error, if one failed; else the first rank that broke off its epoch, if one
        did (looked at every :data:`CHECK_EVERY` s unless `now`; ``None`` when not looked).

        Raises
        ------
        RankFailedError
            Another rank failed; its error is in the message.
        """
        if not now and time.monotonic() - self._looked < CHECK_EVERY:
            return None
        self._looked = time.monotonic()
        for r in range(self.ranks):
            error = self._read("error", r) if r != self.rank else None
            if error is not None:
                raise RankFailedError(f"rank {r} of this node failed while the node's ranks wrote their streams "
                                      f"into generation {self.generation}: {error.get('error')}")
        return self.broke()

    def broke(self) -> int | None:
        """The first other rank that broke off its epoch, ``None`` when none did."""
        return next((r for r in range(self.ranks) if r != self.rank and self._read("broke", r) is not None), None)

    def fail(self, exc: BaseException) -> None:
        """Tell the other ranks that this one fails with `exc` (not when it fails because another did), or,
        for a ``GeneratorExit``, that its loop broke off the epoch (not an error: see :class:`Abandoned`)."""
        if isinstance(exc, RankFailedError):
            return
        try:
            if isinstance(exc, GeneratorExit):
                self.post("broke", {"pid": os.getpid()})
            else:
                self.post("error", {"error": f"{type(exc).__name__}: {exc}", "pid": os.getpid()})
        except OSError:
            pass  # the others then find this process gone

    def gather(self, what: str, of: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The `what` of every rank (or of those `of`), waited for (see the module docstring for what ends
        a wait).

        Raises
        ------
        RankFailedError
            A rank failed, or its process is gone without an answer.
        Abandoned
            A rank broke off its epoch: it will never answer.
        RanksTimeoutError
            A rank did not answer in time.
        """
        start, pause = time.monotonic(), 0.001
        ranks = list(range(self.ranks)) if of is None else list(of)
        got: dict[int, dict[str, Any]] = {}
        while True:
            self.check(now=True)
            for r in ranks:
                if r not in got and (doc := self._read(what, r)) is not None:
                    got[r] = doc
            if len(got) == len(ranks):
                return [got[r] for r in ranks]
            broke = [r for r in ranks if r not in got and self._read("broke", r) is not None]
            if broke:
                raise Abandoned(self.abandoned_by(broke[0]))
            self._gone_or_late(what, [r for r in ranks if r not in got], time.monotonic() - start)
            time.sleep(pause)  # the other ranks' files: nothing to wait on but their arrival
            pause = min(MAX_POLL, pause * 2)

    def _gone_or_late(self, what: str, missing: list[int], waited: float) -> None:
        """Raise when a rank that has not posted `what` never will."""
        for r in missing:
            pid = (self._read("pid", r) or {}).get("pid")
            if isinstance(pid, int) and not pid_alive(pid):
                self.check(now=True)  # its own error says more, if it wrote one
                raise RankFailedError(f"rank {r} of this node (pid {pid}) is gone before it said its {what}: the "
                                      f"node's ranks cannot commit generation {self.generation} of their streams")
            if pid is None and waited > JOIN_TIMEOUT:
                raise RanksTimeoutError(f"rank {r} of this node did not show up within {JOIN_TIMEOUT:.0f} s to say "
                                        f"its {what} (the ranks write their streams into generation "
                                        f"{self.generation}, in {self.where}): every rank iterates its loader")

    def abandoned_by(self, rank: int) -> str:
        """What a rank that broke off its epoch leaves of the generation, in words."""
        return (f"rank {rank} of this node broke off its epoch before the end of its stream: generation "
                f"{self.generation} is not committed")

    # ------------------------------------------------------------------ what the ranks say
    def publish_ticket(self, token: StagingToken) -> None:
        """Local rank 0: the staging area every rank writes into."""
        self.post("ticket", {"staging": os.path.basename(token.path), "compress": token.compress,
                              "allow_pickle": token.allow_pickle})

    def ticket(self, store: Store) -> ShardSpec:
        """The other ranks: local rank 0's staging area, as a ticket to write into it."""
        doc = self.gather("ticket", [0])[0]
        name, compress, pickle = doc.get("staging"), doc.get("compress"), doc.get("allow_pickle")
        # A staging area of this generation by name (one removed since, by local rank 0 gone on to its next
        # epoch, fails at the first write).
        staged = parse_staging(name) if is_file_name(name) else None
        path = os.path.join(store.path, str(name)) if staged is not None and staged[0] == self.generation else ""
        if not (path and isinstance(compress, bool) and isinstance(pickle, bool)):
            raise RankFailedError(f"{self.where}/ticket-0.json does not name a staging area of {store.path}: {doc!r}")
        token = StagingToken(path, self.generation, store.budget(), None, compress, pickle)
        return ShardSpec(store.spec, token)

    def close(self) -> None:
        """This rank is done with the rendezvous; the last one removes it."""
        try:
            (self.where / f"done-{self.rank}").touch()
            if sum(1 for p in self.where.iterdir() if p.name.startswith("done-")) >= self.ranks:
                shutil.rmtree(self.where, ignore_errors=True)
        except OSError:
            pass  # removed by another rank meanwhile


class NodeStreamWriter:
    """This rank's part of a generation the node's ranks write together (see the module docstring).

    Parameters
    ----------
    node
        The rendezvous.
    spec
        The ticket to local rank 0's staging area.
    store
        The node's store (its backend forgets a shard's moved tail).
    """

    def __init__(self, node: NodeStream, spec: ShardSpec, store: Store) -> None:
        self.node, self.spec, self.store = node, spec, store
        self.shard_id = f"rank-{node.rank}"
        self.block = BLOCK  # (the module's, when it is made: a test makes it small)
        #: Why nothing more is written (another rank broke off its epoch), ``None`` while it is.
        self.abandoned: str | None = None
        self.shard: ShardWriter | None = None
        try:
            self.shard = spec.open(self.shard_id)
        except (OSError, CacheStoreError):
            self._abandon_if_broke()

    def _abandon_if_broke(self) -> None:
        """After a write that failed: nothing more is written where another rank broke off its epoch, else
        the error is this rank's (re-raised). Local rank 0 that broke off removes the staging area as it
        goes on to its next epoch: the others serve the rest of their streams."""
        broke = self.node.broke()
        if broke is None:
            raise
        self.abandoned = self.node.abandoned_by(broke)

    def put(self, k: int, sample: Sample) -> int:
        """Write this rank's `k`-th sample (unless the generation was abandoned); its index."""
        index = interleaved(k, self.node.rank, self.node.ranks, self.block)
        if self.abandoned is None and self.shard is not None:
            try:
                self.shard.put(index, sample)
            except (OSError, CacheStoreError):
                self._abandon_if_broke()
        return index

    def check(self) -> None:
        """Raise another rank's error, if one failed; stop writing if one broke off its epoch."""
        broke = self.node.check()
        if broke is not None and self.abandoned is None:
            self.abandoned = self.node.abandoned_by(broke)

    def fail(self, exc: BaseException) -> None:
        """Tell the other ranks that this one fails with `exc`."""
        self.node.fail(exc)

    def end(self, count: int) -> int:
        """The generation's length, after this rank wrote `count` samples: its samples past the end
        moved into holes, and (local rank 0, which commits next) every rank's moves done.

        Raises
        ------
        Abandoned
            Another rank broke off its epoch.
        """
        if self.abandoned is not None or self.shard is None:
            raise Abandoned(self.abandoned or "")
        self.shard.close()
        said = [doc.get("count") for doc in self._say("count", {"count": count})]
        counts = [c for c in said if isinstance(c, int) and not isinstance(c, bool) and c >= 0]
        if len(counts) != len(said):
            raise RankFailedError(f"the ranks' counts in {self.node.where} are not counts: {said!r}")
        total = sum(counts)
        mine = moves(counts, self.block)[self.node.rank]
        if mine:
            self._move(mine, count)
        self.node.post("moved", {"moved": len(mine)})
        if self.node.rank == 0 and total:
            self.node.gather("moved")
        return total

    def _say(self, what: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
        self.node.post(what, doc)
        return self.node.gather(what)

    def _move(self, mine: list[tuple[int, int]], count: int) -> None:
        """Copy this rank's samples past the end into their holes, then forget them in its shard (its
        last rows: its indices grow with its arrivals)."""
        staging = self.spec.open_staging()
        if staging is None:
            raise RankFailedError(f"the {self.store.backend_name} backend cannot read back a staging area: the "
                                  "node's ranks cannot end a generation of uneven streams with it")
        moved = self.spec.open(f"{self.shard_id}-moved")
        try:
            for old, new in mine:
                moved.put(new, staging.read(old))
        finally:
            moved.close()
            staging.close()
        self.store.backend.discard_shard_tail(self.spec.token, self.shard_id, count - len(mine))

    def committed(self, generation: int | None) -> None:
        """Local rank 0: `generation` is committed."""
        self.node.post("end", {"committed": generation})

    def await_commit(self) -> None:
        """The other ranks: wait until local rank 0 committed the generation."""
        self.node.gather("end", [0])

    def close(self) -> None:
        """Close this rank's shard (what it wrote stays for the commit, or the partial generation) and
        leave the rendezvous."""
        try:
            if self.shard is not None:
                self.shard.close()
        except Exception:  # what it could not flush is not committed; the error that ends the epoch says why
            pass
        self.node.close()
