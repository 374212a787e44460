"""Build the bind shim (``bind_to_pod_ip.c``) that makes wildcard listens per pod.

Compiled with the system C compiler into the agent's state directory at start (nothing built
is committed). Without a compiler the agent still runs, with a warning: pods then share the
wildcard port space, so two pods cannot both listen on ``0.0.0.0:<port>``.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("bind_to_pod_ip.c")


def build_shim(out_dir: Path) -> tuple[Path | None, str]:
    """Compile the shim into ``out_dir``; returns ``(path or None, message)``."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler found: wildcard binds are not isolated per pod"
    out = out_dir / "bind_to_pod_ip.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"building the bind shim failed: {proc.stderr.strip()[:500]}"
    return out, f"wildcard binds go to the pod IP (LD_PRELOAD={out})"
