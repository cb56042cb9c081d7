"""``ragfix serve`` as a subprocess on a free port (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str, host: str = "127.0.0.1", timeout: float = 180.0) -> Iterator[str]:
    """Run ``ragfix serve ARGS`` as a subprocess on a free port of ``host`` (one thread per
    math library) until the block ends; yields its ``/v1`` base URL once ``/health`` answers.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds (its
            last output in the message).
    """
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from ragfix.models.device import parent_death_signal

    port = free_port(host)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ragfix.cli", "serve", *args, "--host", host, "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=parent_death_signal(),
    )
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ragfix serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ragfix serve did not answer in {timeout:.0f} s") from None
                time.sleep(0.5)
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


__all__ = ["free_port", "serving"]
