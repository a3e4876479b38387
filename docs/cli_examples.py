"""Build the example stores of docs/cli.md and README.md, run the commands shown there, print the transcript.

    PYTHONPATH=. python docs/cli_examples.py /tmp/cli-examples > transcript.txt

The stores carry what the loader records: a fingerprint with the keys of
``loader.cache.fingerprint.dataset_fingerprint``, a producer, and each commit's
``extra`` (the epoch that wrote the generation and ``update_frequency``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import multiprocessing as mp
import os
import shutil
import signal
import sys

import numpy as np

from cachestore import open_store
from cachestore.cli import main
from loader.cache.fingerprint import params_hash

K = 5  # update_frequency


def params(side: int) -> dict:
    return {"root": "/data/train", "image_size": side}


def fingerprint(length: int, side: int, consumer: int = 0, consumers: int = 1) -> dict:
    return {"dataset": "mypkg.MyDataset", "params_sha256": params_hash(params(side)), "length": length,
            "source_sha256": hashlib.sha256(b"mypkg/dataset.py").hexdigest()[:16],
            "partition": [consumer, consumers]}


def producer(k: int, side: int, consumer: int = 0, consumers: int = 1) -> dict:
    return {"dataset": "mypkg.MyDataset", "params": params(side), "update_frequency": k, "batch_size": 64,
            "consumer": [consumer, consumers]}


def sample(rng: np.random.Generator, i: int, side: int) -> dict:
    return {"image": rng.integers(0, 255, (side, side, 3), dtype=np.uint8), "label": i % 10}


def write(path: str, gen: int, n: int, side: int = 64, k: int = K, consumer: int = 0, consumers: int = 1) -> None:
    store = open_store(path, fingerprint=fingerprint(n, side, consumer, consumers),
                       producer=producer(k, side, consumer, consumers))
    rng = np.random.default_rng(gen)
    with store.writer(gen, num_samples=n) as writer:
        for i in range(n):
            writer.put(i, sample(rng, i, side))
        writer.commit(extra={"epochs": [gen * k], "update_frequency": k})  # as the loader does
    store.close()


def writing(path: str, gen: int, n: int, side: int, written: int, rotation: bool, ready, stop) -> None:
    """A training run writing generation `gen` (and a disk rotation window): it holds until stopped or killed.

    It joins the generation's shared staging area, as the loader's writers do by default (memmap,
    ``shared=True``): killed, it leaves a partial generation the next run completes.
    """
    store = open_store(path, fingerprint=fingerprint(n, side), producer=producer(K, side))
    rng = np.random.default_rng(gen)
    writer = store.join(gen, num_samples=n)
    for i in range(written):
        writer.put(i, sample(rng, i, side))
    if rotation:  # the loader's rotation window, simulated
        window = os.path.join(path, f"rotation-{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(window)
        with open(os.path.join(window, "slot-0.rec"), "wb") as f:
            f.write(rng.bytes(4 << 20))
    ready.set()
    stop.wait(120)
    writer.keep()


def run(*argv: str, note: str = "") -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    print(f"$ cachestore {' '.join(argv)}{note}\n{out.getvalue()}[exit {code}]\n", flush=True)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def main_script(base: str) -> None:
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    os.chdir(base)
    ctx = mp.get_context("spawn")

    # Two generate epochs (0-4, 5-9), then a loader run killed while it generated epochs 10-14: the
    # partial generation it leaves is kept for the next run.
    write("cache", 0, 2000)
    write("cache", 1, 2000)
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=writing, args=("cache", 2, 2000, 64, 700, True, ready, stop))
    proc.start()
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    print("### crashed run\n")
    run("inspect", "cache")
    run("prune", "cache", "--dry-run")
    run("prune", "cache")
    rows = 64 * 64 * 3  # the "image" column: one row per sample
    for index in (17, 1203):
        flip("cache/gen-000001/col-0.bin", index * rows + rows // 2)
    run("inspect", "cache", "--verify", note="    # after flipping one byte in samples 17 and 1203")
    run("inspect", "/nonexistent/cache")

    print("### damaged generation\n")
    write("old", 0, 500, side=32)
    write("old", 1, 500, side=32)
    os.unlink("old/gen-000000/manifest.json")
    run("inspect", "old", "--verify", note="    # after deleting gen-000000/manifest.json")
    run("prune", "old", "--keep", "5")

    print("### live writer\n")
    write("live", 0, 500, side=32)
    write("live", 1, 500, side=32)
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=writing, args=("live", 2, 500, 32, 300, False, ready, stop))
    proc.start()
    assert ready.wait(60)
    run("prune", "live", "--keep", "1")
    stop.set()
    proc.join(60)

    print("### a store per rank\n")
    # Two ranks with cache_setting["scope"] = "rank" and update_frequency=2: generations 0, 1, 2 serve
    # epochs 0-1, 2-3, 4-5.
    for consumer in range(2):
        for gen in range(3):
            write(f"prefix/consumer-{consumer}-of-2", gen, 500, side=32, k=2, consumer=consumer, consumers=2)
    run("inspect", "prefix")
    run("prune", "prefix", "--keep", "3", "--max-bytes", "3.5MiB", "--dry-run")


if __name__ == "__main__":
    main_script(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "cli-examples"))
