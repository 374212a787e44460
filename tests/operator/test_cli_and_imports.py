"""The ``shardline-operator`` command line, and the operator package never importing torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import shardline_operator
from shardline_operator.cli import make_parser

ROOT = Path(__file__).resolve().parents[2]


def test_parser_defaults_and_namespaces():
    args = make_parser().parse_args([])
    assert args.namespace == [] and args.log_level == "info"
    assert args.liveness_endpoint.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    args = make_parser().parse_args(["-n", "a", "--namespace", "b", "--liveness-endpoint", "http://10.0.0.5:8080/healthz"])
    assert args.namespace == ["a", "b"] and args.liveness_endpoint == "http://10.0.0.5:8080/healthz"


def test_no_module_imports_torch():
    modules = [m.name for m in pkgutil.walk_packages(shardline_operator.__path__, prefix="shardline_operator.")]
    assert "shardline_operator.render.statefulset" in modules
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'shardline_runtime')\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "operator"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert len(modules) >= 15
