"""The Gateway API Inference Extension (GIE) for tests and benches: its endpoint picker (EPP)
built from Go modules, its CRDs from the same module, and the EPP run as a local process
against a cluster's API server.

The EPP is built once into ``~/.cache/shardline/gie-VERSION/epp`` (``$SHARDLINE_CACHE`` moves the
root; a cold build takes tens of minutes on two loaded cores): ``go mod download`` fetches the
module at VERSION, and ``go build ./cmd/epp`` runs in its source with its own go.mod and go.sum.
Not ``go install ...@VERSION``: that also asks the module proxy for the module's version list
(its deprecation check), which a proxy may refuse (403), as one did here. Concurrent builders
take turns on a lock file. The CRDs are the module's ``config/crd/bases`` in the Go
module cache (``go mod download`` fetches them when missing). Usable from the shell:
``python3 -m hack.gie build``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hack.localcluster import processes
from hack.localcluster.build import _go_env, cache_root, cached_go_build, go_release_build
from hack.localcluster.processes import free_port

GIE_VERSION = "v1.5.0"
MODULE = "sigs.k8s.io/gateway-api-inference-extension"


def binary(version: str = GIE_VERSION) -> Path:
    """Where the EPP binary of ``version`` lives in the cache."""
    return cache_root() / f"gie-{version}" / "epp"


def ensure_epp(version: str = GIE_VERSION) -> Path:
    """Build the EPP when missing (:func:`~hack.localcluster.build.cached_go_build`); return the
    binary's path.

    Raises:
        RuntimeError: the build failed (the command and its output tail).
    """
    what = "build the GIE endpoint picker"

    def build(partial: Path) -> None:
        source = module_dir(version)
        go_release_build(["build", "-o", str(partial), "./cmd/epp"], source, _go_env(source), what)

    return cached_go_build(binary(version), what, build)


def module_dir(version: str = GIE_VERSION) -> Path:
    """The GIE module's source in the Go module cache (downloaded when missing).

    Raises:
        RuntimeError: ``go mod download`` failed.
    """
    out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{version}"], capture_output=True,
                         text=True, env=_go_env(Path.cwd()), cwd=tempfile.gettempdir(), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}@{version} failed:\n{out.stdout}\n{out.stderr}")
    import json

    return Path(json.loads(out.stdout)["Dir"])


def crd_files(version: str = GIE_VERSION) -> list[Path]:
    """The module's CRD manifests (InferencePool v1, InferenceObjective, InferenceModelRewrite,
    InferencePoolImport): the EPP watches the first three, so all must be installed."""
    return sorted((module_dir(version) / "config" / "crd" / "bases").glob("*.yaml"))


class Epp:
    """The EPP binary serving one InferencePool, on loopback ports, reading the cluster through
    ``kubeconfig``. ``args`` are the chart's EPP flags (``shardline.eppArgs``); the ports, plain
    gRPC (``--secure-serving=false``: the test client is the Envoy here) and ``config_text``
    (the chart's ConfigMap) are added. ``target`` is its ext-proc ``host:port``."""

    def __init__(self, kubeconfig: Path, args: list[str], config_text: str, log_dir: Path) -> None:
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.log_path = log_dir / f"epp-{self.grpc_port}.log"
        config = log_dir / f"epp-{self.grpc_port}.yaml"
        config.write_text(config_text)
        drop = ("--grpc-port", "--config-file", "--config-text")
        self.cmd = [str(ensure_epp()), *[a for a in args if not a.startswith(drop)],
                    f"--grpc-port={self.grpc_port}", f"--grpc-health-port={self.health_port}",
                    f"--metrics-port={self.metrics_port}", "--secure-serving=false", "--enable-pprof=false",
                    "--refresh-prometheus-metrics-interval=200ms",
                    f"--config-file={config}"]
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Epp:
        self._proc = processes.start(self.log_path.stem, self.cmd, self.log_path.parent, env=self.env)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            processes.stop(self._proc.pid)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metric(self, name: str) -> dict[str, float]:
        """Samples of the EPP's own Prometheus metric ``name``: ``{label text: value}``."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                key, _, value = line.rpartition(" ")
                out[key[len(name):]] = float(value)
        return out

    def wait_listening(self, timeout: float = 60) -> None:
        """Until the ext-proc port accepts connections. Raises RuntimeError (with the log tail)
        when the EPP exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"the EPP exited {self._proc.returncode}:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the EPP did not listen on {self.target} within {timeout}s:\n{self.log_tail()}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python3 -m hack.gie build", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(ensure_epp(), f"({time.monotonic() - started:.0f} s)")
    return 0
