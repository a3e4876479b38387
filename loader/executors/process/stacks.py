"""A worker's Python stack, taken while it is stuck: what a timeout error shows of it.

A worker process dumps its stack into an unlinked file on SIGUSR1 (:func:`stack_dump_file`, set up at
its start); the training process signals it and reads the dump through ``/proc/<pid>/fd/<fd>``
(:func:`process_stack`). A thread's frames are read from this process (:func:`thread_stack`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import tempfile
import time
from typing import Any

#: Seconds to wait for a worker's stack dump.
STACK_TIMEOUT = 2.0


def stack_dump_file() -> Any:
    """An unlinked temporary file that this process's Python stack is dumped into on SIGUSR1.

    When a batch times out, the training process signals the worker and reads
    the dump through ``/proc/<pid>/fd/<fd>``: faulthandler writes it from the
    signal handler itself, so it works even while ``__getitem__`` is stuck in C
    code. Unlinked from the start, the file disappears with the process.
    """
    dump = tempfile.TemporaryFile(prefix="cachestore-stack-")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    return dump


def process_stack(pid: int | None, stack_fd: int) -> str:
    """Worker process `pid`'s Python stack now, from the faulthandler dump it writes into its file
    `stack_fd` on SIGUSR1 (or why it is not available)."""
    if pid is None or stack_fd < 0:
        return "(not available: the worker had not finished starting)"
    try:
        fd = os.open(f"/proc/{pid}/fd/{stack_fd}", os.O_RDONLY)
    except OSError as exc:
        return f"(not available: {exc.strerror})"
    try:
        start = os.fstat(fd).st_size
        os.kill(pid, signal.SIGUSR1)
        # faulthandler writes the dump from the signal handler: wait until it stops growing.
        deadline, size = time.monotonic() + STACK_TIMEOUT, start
        while time.monotonic() < deadline:
            time.sleep(0.01)
            now = os.fstat(fd).st_size
            if now > start and now == size:
                break
            size = now
        return os.pread(fd, size - start, start).decode(errors="replace") or "(no stack was written)"
    except OSError as exc:
        return f"(not available: {exc.strerror})"
    finally:
        os.close(fd)


def thread_stack(ident: int | None) -> str:
    """The Python stack of thread `ident` of this process, from faulthandler's dump of every thread."""
    with tempfile.TemporaryFile(mode="w+") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        text = dump.read()
    # Blocks start with "Thread 0x..." or "Current thread 0x..." and end at a blank line.
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
        match = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", block)
        if match and ident is not None and int(match.group(1), 16) == ident:
            return block.strip()
    return "(the thread has ended)"
