"""Tiny model revisions under the hostPath ``/var/lib/shardline/models`` that examples mount.

Checkpoints are written to a temporary sibling and renamed into place, so concurrent sessions
(and a checkpoint half-written by an interrupted run) never expose a partial directory.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS_ROOT = Path(os.environ.get("SHARDLINE_MODELS_ROOT", "/var/lib/shardline/models"))


def write_tiny_model(path: Path, seed: int, arch: str = "llama",
                     overrides: dict[str, str] | None = None) -> Path:
    """Write a tiny checkpoint + tokenizer (``python -m shardline_runtime.tiny_checkpoint``)
    at ``path`` unless one is there. ``overrides`` are ``--set KEY=JSON`` config values.

    Raises RuntimeError with the command's output if the writer fails.
    """
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    cmd = [sys.executable, "-m", "shardline_runtime.tiny_checkpoint", str(tmp),
           "--arch", arch, "--seed", str(seed)]
    for key, value in (overrides or {}).items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    tmp.chmod(0o755)
    try:
        tmp.rename(path)
    except OSError:  # another session won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def readable_by_all(tree: Path) -> Path:
    """Add read permission for everyone to every file under ``tree`` (and read+search to its
    directories), since runtime pods run as uid 10001 and read the hostPath as that user;
    ``save_pretrained`` writes ``model.safetensors`` with mode 0600. Returns ``tree``."""
    for path in [tree, *tree.rglob("*")]:
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)
    return tree


def write_revisions(root: Path = MODELS_ROOT) -> dict[str, Path]:
    """The three revisions the demo and e2e use: ``rev-a`` (seed 1), ``rev-b`` (seed 2) and
    ``rev-broken`` (same architecture, hidden size 128 instead of 64: every parameter shape
    differs, so an in-place update must be refused)."""
    base = root / "tiny-llama"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise RuntimeError(
            f"cannot create {base}: the examples mount the hostPath {root}; make it writable "
            f"first, e.g. `sudo install -d -o $USER {root}`") from None
    return {
        "rev-a": write_tiny_model(base / "rev-a", seed=1),
        "rev-b": write_tiny_model(base / "rev-b", seed=2),
        "rev-broken": write_tiny_model(base / "rev-broken", seed=3,
                                       overrides={"hidden_size": "128"}),
    }


def write_text_revisions(root: Path = MODELS_ROOT, log=print) -> dict[str, Path]:
    """The demo's readable model (``hack/scenario/text_model.py``: trained once and cached)
    copied to ``<root>/text-llama/{rev-a,rev-b}``, each written to a temporary sibling and
    renamed into place."""
    from hack.scenario.text_model import ensure_text_model

    base = root / "text-llama"
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, source in ensure_text_model(log).items():
        target = base / name
        marker = target / ".source"
        if not (marker.is_file() and marker.read_text() == str(source)):
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=base))
            shutil.copytree(source, tmp, dirs_exist_ok=True)
            (tmp / ".source").write_text(str(source))
            readable_by_all(tmp)
            if target.exists():
                shutil.rmtree(target)
            try:
                tmp.rename(target)
            except OSError:  # another session won the race with the same files
                shutil.rmtree(tmp, ignore_errors=True)
        out[name] = readable_by_all(target)  # copies left by older versions were 0600
    return out
