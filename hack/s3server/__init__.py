"""A real S3-compatible server for tests: versitygw (Apache-2.0, a Go module) over a directory.

Built once with ``go install github.com/versity/versitygw/cmd/versitygw@VERSION`` into
``~/.cache/shardline/versitygw-VERSION/bin`` (``$SHARDLINE_CACHE`` moves the root), as
``hack/localcluster`` builds Kubernetes; concurrent builders take turns on a lock file.
:class:`S3Server` runs it on a loopback port with its POSIX backend (objects are files under a
temporary directory, metadata in sidecar files) and one root access key. Usable from the shell:
``python3 -m hack.s3server build``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hack.localcluster.build import cache_root, go_install_cached
from hack.localcluster.processes import free_port

VERSITYGW_VERSION = "v1.8.0"
MODULE = "github.com/versity/versitygw/cmd/versitygw"
ACCESS_KEY = "shardline-test"
SECRET_KEY = "shardline-test-secret"
REGION = "us-east-1"


def binary(version: str = VERSITYGW_VERSION) -> Path:
    """Where the versitygw binary of ``version`` lives in the cache."""
    return cache_root() / f"versitygw-{version}" / "bin" / "versitygw"


def ensure_versitygw(version: str = VERSITYGW_VERSION) -> Path:
    """Build versitygw when missing (minutes on a cold Go cache); return the binary's path.

    Raises:
        RuntimeError: the build failed (the command and its output tail).
    """
    return go_install_cached(MODULE, version, binary(version), "build versitygw")


class S3Server:
    """versitygw serving ``root`` (a new temporary directory when ``None``) on 127.0.0.1.

    ``endpoint`` is its URL; ``env`` the variables a boto3 client (and the runtime) reads to
    reach it. Buckets are directories under ``root``; an object's bytes are a file there, so a
    test may corrupt one in place.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="shardline-s3-"))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> S3Server:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        (self.root / "meta").mkdir(parents=True, exist_ok=True)
        cmd = [
            str(ensure_versitygw()),
            "--port", f"127.0.0.1:{self.port}",
            "--access", ACCESS_KEY,
            "--secret", SECRET_KEY,
            "--region", REGION,
            "posix", "--sidecar", str(self.root / "meta"), str(self.root / "data"),
        ]  # fmt: skip
        self._log = open(self.root / "versitygw.log", "w")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"versitygw exited: {(self.root / 'versitygw.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"versitygw did not listen on {self.endpoint} within 30 s")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def object_path(self, bucket: str, key: str) -> Path:
        """The file holding an object's bytes."""
        return self.root / "data" / bucket / key


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python3 -m hack.s3server build", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(ensure_versitygw(), f"({time.monotonic() - started:.0f} s)")
    return 0
