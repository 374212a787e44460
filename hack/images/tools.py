"""Logging and subprocess helpers shared by the image build steps."""
from __future__ import annotations

import subprocess
import sys
import time


def log(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], what: str, echo: bool = False) -> str:
    """Run ``cmd``; return its stdout. With ``echo`` the output streams to stderr (long builds
    show progress). Raises subprocess.CalledProcessError with the output tail on failure."""
    started = time.monotonic()
    log(f"{what}: {' '.join(cmd)}")
    if echo:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            print("    " + line.rstrip(), file=sys.stderr, flush=True)
        rc = proc.wait()
        out = "".join(lines)
    else:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        rc, out = done.returncode, done.stdout
        if rc:
            out += done.stderr
    log(f"{what}: {time.monotonic() - started:.0f} s (exit {rc})")
    if rc:
        raise subprocess.CalledProcessError(rc, cmd, output=out[-4000:])
    return out


def image_exists(name: str) -> bool:
    """Whether buildah's local storage holds ``name``."""
    return subprocess.run(["buildah", "inspect", "--type", "image", name],
                          capture_output=True, check=False).returncode == 0
