"""A file truncated under an open generation is an error naming it, never a SIGBUS.

A reader maps a generation's files; cutting one (anyone who can write the store can) made the
next read of a page beyond its new end a SIGBUS that killed the reader. Each case runs in a
child process (a SIGBUS there fails the test instead of ending the test run): the generation is
read, its file cut to a quarter, then read again, by batch, sample, verify or explicit rows,
through the compiled gather and the pure-Python one.
"""

from __future__ import annotations

import signal

import pytest

from cachestore import open_store

from .helpers import WAIT, fixed_sample, fault_unguarded, read_truncated, recv, variable_sample, write_generation

N = 64


def _run(children, path: str, victim: str, read: str, gather: str) -> tuple[str, str]:
    proc, conn = children(read_truncated, path, victim, read, gather)
    result = recv(conn)
    proc.join(WAIT)
    assert proc.exitcode == 0, f"the reader died (exit code {proc.exitcode}: -{int(signal.SIGBUS)} is SIGBUS)"
    return result


@pytest.mark.parametrize("read", ["batch", "sample", "verify", "rows"])
@pytest.mark.parametrize("gather", ["compiled", "python"])
def test_a_column_cut_under_a_memmap_reader(store_path, children, read, gather, native):
    with open_store(store_path, "memmap") as store:
        write_generation(store, 0, N, lambda g, i: {"image": fixed_sample(g, i)["image"].repeat(64, 0), "y": i})
    kind, message = _run(children, store_path, "col-0.bin", read, gather)
    assert kind in ("CorruptSampleError", "verify") and "col-0.bin" in message and "truncated" in message, message


@pytest.mark.parametrize("read", ["batch", "sample", "verify"])
def test_a_segment_cut_under_a_memmap_reader(store_path, children, read):
    with open_store(store_path, "memmap") as store:
        write_generation(store, 0, N, variable_sample)
    kind, message = _run(children, store_path, "*.seg", read, "compiled")
    assert kind in ("CorruptSampleError", "verify") and ".seg" in message, message


@pytest.mark.parametrize("read", ["batch", "sample", "verify"])
@pytest.mark.parametrize("make", [fixed_sample, lambda g, i: {"wide": fixed_sample(g, i)["image"].repeat(64, 0)}],
                         ids=["columns", "wide-records"])
def test_the_data_file_cut_under_an_lmdb_reader(store_path, children, read, make):
    with open_store(store_path, "lmdb") as store:
        write_generation(store, 0, N, make)
    kind, message = _run(children, store_path, "data.mdb", read, "compiled")
    assert kind in ("CorruptSampleError", "verify") and "data.mdb" in message and "truncated" in message, message


@pytest.mark.parametrize("faulthandler_after", [False, True], ids=["alone", "faulthandler-after"])
def test_the_guard_catches_only_its_own_faults(tmp_path, children, native, faulthandler_after):
    # A SIGBUS outside the compiled gather still ends the process, as it did before the guard
    # (and does not loop between the guard and a handler installed after it).
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * 16 * 64)
    proc, conn = children(fault_unguarded, str(path), faulthandler_after)
    assert recv(conn) == "guarded fault reported"
    proc.join(WAIT)
    assert proc.exitcode == -signal.SIGBUS
