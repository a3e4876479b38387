"""One leg of a run over a stream iterated in the training process, in a fresh process.

python -m tests.loader.streams.identity_script OUT.json --kind passes|wds --root DIR --setting JSON
    [--load STATE] [--stop-after N] [--epochs E]

``passes``: :class:`FilesCountingPasses` over the ``.npy`` files of ``DIR/files``; ``wds``: a resampled
webdataset pipeline over the tar shards of ``DIR/shards`` (seeded: its identity is the same in every
process). Both change their own attributes as they are iterated. Writes the labels served, one list per
batch, and the state (pickled, hex) taken after `N` batches, or at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle

import numpy as np

from loader import CachedLoader


class FilesCountingPasses:
    """A stream of the samples in a directory's ``.npy`` files, counting its passes in an attribute."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        for name in sorted(os.listdir(self.directory)):
            yield {"i": np.load(os.path.join(self.directory, name))}


def write_files(root: str, n: int) -> None:
    os.makedirs(os.path.join(root, "files"), exist_ok=True)
    for i in range(n):
        np.save(os.path.join(root, "files", f"{i:04d}.npy"), np.array([i], dtype=np.int64))


def write_shards(root: str, shards: int, per_shard: int) -> list[str]:
    import webdataset as wds

    os.makedirs(os.path.join(root, "shards"), exist_ok=True)
    urls = []
    for shard in range(shards):
        path = os.path.join(root, "shards", f"shard-{shard:03d}.tar")
        with wds.TarWriter(path) as sink:
            for k in range(per_shard):
                sink.write({"__key__": f"{shard * per_shard + k:06d}", "cls": shard * per_shard + k})
        urls.append(path)
    return urls


def stream(kind: str, root: str):
    if kind == "passes":
        return FilesCountingPasses(os.path.join(root, "files"))
    import webdataset as wds

    urls = sorted(os.path.join(root, "shards", n) for n in os.listdir(os.path.join(root, "shards")))
    pipeline = wds.WebDataset(urls, resampled=True, shardshuffle=False, seed=0).decode().to_tuple("cls")
    return pipeline.map(lambda t: {"i": np.array([t[0]], dtype=np.int64)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--setting", required=True)
    parser.add_argument("--load", default=None)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    served: list[list[int]] = []
    state = None
    with CachedLoader(stream(args.kind, args.root), num_workers=0, **json.loads(args.setting)) as loader:
        if args.load:
            with open(args.load, "rb") as f:
                loader.load_state_dict(pickle.load(f))
        for _ in range(loader.epoch, args.epochs):
            for batch in loader:
                served.append(np.asarray(batch["i"]).ravel().tolist())
                if len(served) == args.stop_after:
                    state = loader.state_dict()
                    break
            if state is not None:
                break
        state = state if state is not None else loader.state_dict()
    with open(args.out, "w") as f:
        json.dump({"served": served, "state": pickle.dumps(state).hex()}, f)


if __name__ == "__main__":
    main()
