"""CachedLoader in a real Jupyter kernel: a dataset class and a lambda defined in a cell reach spawned workers.

The kernel is this venv's Python running ipykernel, driven through jupyter_client as a notebook front
end drives it, one cell at a time. Pickle cannot name what a cell defines (it lives in the kernel's
``__main__``, which a spawned worker does not have): the loader sends it by value.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

N, EPOCHS = 30, 2
CELL_TIMEOUT = 60  # seconds for one cell; the kernel itself starts within KERNEL_START

KERNEL_START = 60

CELLS = [
    # 1. A dataset class whose constructor stores a lambda: neither can be pickled by name.
    """
    import os
    import numpy as np

    class Squares:
        def __init__(self, n):
            self.n = n
            self.transform = lambda i: np.array([i * i, -i], dtype=np.int64)

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"x": self.transform(i), "i": i, "pid": os.getpid()}
    """,
    # 2. The loader, from an instance.
    """
    from loader import CachedLoader

    loader = CachedLoader(Squares({n}), batch_size=4, num_workers=2,
                          cache_setting={{"prefix": {prefix!r}, "update_frequency": 2}})
    """,
    # 3. Two epochs; what they served, printed as JSON.
    """
    import json

    served = []
    for epoch in range({epochs}):
        served.append([[int(i), row.tolist(), int(pid)] for batch in loader
                       for i, row, pid in zip(batch["i"], batch["x"], batch["pid"])])
    print(json.dumps({{"served": served, "workers": loader.worker_pids(), "kernel": os.getpid(),
                      "stats": [[s.epoch, s.mode.value, s.generation] for s in loader.epoch_stats]}}))
    """,
    # 4. Closing the loader ends its workers.
    """
    import psutil

    loader.close()
    print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)
                      if p.status() != psutil.STATUS_ZOMBIE
                      and not any("resource_tracker" in part for part in p.cmdline())]))
    """,
]


def start_kernel(tmp_path):
    """This venv's ipykernel, from a kernel spec under `tmp_path`, its files (connection file,
    IPython's history) there too."""
    kernels = tmp_path / "kernels"
    (kernels / "cachestore-test").mkdir(parents=True)
    (kernels / "cachestore-test" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "cachestore tests", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    km = KernelManager(kernel_name="cachestore-test", kernel_spec_manager=specs,
                       connection_file=str(tmp_path / "connection.json"))
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    try:
        km.start_kernel(cwd=str(tmp_path), env=env)
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"a Jupyter kernel cannot start here: {exc}")
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=KERNEL_START)
    except RuntimeError as exc:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        pytest.skip(f"a Jupyter kernel did not become ready within {KERNEL_START} s: {exc}")
    return km, kc


def run_cell(kc, code: str) -> str:
    """Run one cell; its stdout, or a failure with the cell's traceback."""
    out: list[str] = []
    errors: list[str] = []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(textwrap.dedent(code), timeout=CELL_TIMEOUT, output_hook=hook)
    if reply["content"]["status"] != "ok" or errors:
        pytest.fail(f"cell failed:\n{textwrap.dedent(code)}\n" + "\n".join(errors), pytrace=False)
    return "".join(out)


@pytest.mark.timeout(150)
def test_a_notebook_dataset_with_a_lambda_is_cached_by_spawned_workers(no_leaks):
    km, kc = start_kernel(no_leaks)
    try:
        run_cell(kc, CELLS[0])
        run_cell(kc, CELLS[1].format(n=N, prefix=str(no_leaks / "cache")))
        result = json.loads(run_cell(kc, CELLS[2].format(epochs=EPOCHS)))
        left = json.loads(run_cell(kc, CELLS[3]))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    served, workers = result["served"], result["workers"]
    for epoch in served:
        assert sorted(i for i, _, _ in epoch) == list(range(N)), "every index once per epoch"
        assert all(x == [i * i, -i] for i, x, _ in epoch), "the lambda's values"
    assert [i for i, _, _ in served[1]] != [i for i, _, _ in served[0]], "a new order every epoch"
    # Epoch 0 computed in the workers (not the kernel) and written; epoch 1 read those same samples back.
    assert len(workers) == 2 and result["kernel"] not in workers
    assert {pid for _, _, pid in served[0]} <= set(workers)
    assert sorted(served[1]) == sorted(served[0])
    assert result["stats"] == [[0, "generate", 0], [1, "read", 0]]
    assert left == [], "the workers ended with loader.close()"
