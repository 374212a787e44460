"""The prometheus-operator's own CRDs (``monitoring.coreos.com``), fetched once and cached.

The chart's ServiceMonitor and PrometheusRule are checked against the real CRD schemas: the
prometheus-operator Go module ships them under ``example/prometheus-operator-crd/``, so the
Go module proxy serves them (``go mod download -json github.com/prometheus-operator/
prometheus-operator@VERSION`` unpacks the module and prints its directory). The files needed
are copied into ``~/.cache/shardline/prometheus-operator-VERSION/crds/`` (``SHARDLINE_CACHE``
moves the root) and reused; nothing is committed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .build import cache_root

PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
MODULE = "github.com/prometheus-operator/prometheus-operator"
CRD_FILES = ("monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_podmonitors.yaml",
             "monitoring.coreos.com_prometheusrules.yaml")


def crd_dir(version: str = PROMETHEUS_OPERATOR_VERSION) -> Path:
    return cache_root() / f"prometheus-operator-{version}" / "crds"


def ensure_crds(version: str = PROMETHEUS_OPERATOR_VERSION) -> list[Path]:
    """Paths of the cached CRD files, downloading the module first on a miss.

    Raises RuntimeError (with go's output) when ``go`` is missing or the proxy cannot serve it.
    """
    out = crd_dir(version)
    paths = [out / name for name in CRD_FILES]
    if all(p.is_file() for p in paths):
        return paths
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the `go` command is needed once to fetch the prometheus-operator CRDs")
    with tempfile.TemporaryDirectory() as work:  # outside any module: a plain download
        env = dict(os.environ, GOFLAGS="-mod=mod", GOTOOLCHAIN=os.environ.get("GOTOOLCHAIN", "local"))
        proc = subprocess.run([go, "mod", "download", "-json", f"{MODULE}@{version}"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}@{version} failed:\n{proc.stdout}\n{proc.stderr}")
    source = Path(json.loads(proc.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    out.mkdir(parents=True, exist_ok=True)
    for name in CRD_FILES:
        tmp = out / f".{name}.partial"
        shutil.copyfile(source / name, tmp)
        tmp.replace(out / name)
    return paths
