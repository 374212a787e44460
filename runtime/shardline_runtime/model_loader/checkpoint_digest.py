"""A cheap fingerprint of a checkpoint directory: which weights a server is serving.

Reading every tensor byte of a multi-GB checkpoint to hash it would cost as much as loading it,
so the digest covers what identifies a safetensors checkpoint without its tensor data:

- ``config.json`` and ``model.safetensors.index.json`` (whole files, when present);
- for each ``*.safetensors`` file, in name order: its name, its size in bytes, its header (the
  8-byte little-endian length and the JSON that lists every tensor's dtype, shape and byte
  offsets, plus the writer's ``__metadata__``), and three samples of its tensor data of
  :data:`SAMPLE_BYTES` each (at the start, middle and end of the data).

The header alone is not enough: a fine-tuned revision of the same model has byte-identical
headers (same names, shapes and offsets), so the samples tell such revisions apart. The cost is
one small read per sample: about 200 KiB per file whatever the checkpoint size (a 140 GB,
30-shard checkpoint reads 6 MiB). Two checkpoints that differ only in bytes outside the samples
get the same digest; the digest answers "do these groups load the same files", which is what
mixed-version detection needs, not a cryptographic proof of every byte.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the header length
SAMPLE_BYTES = 64 * 1024
_WHOLE_FILES = ("config.json", "model.safetensors.index.json")


def checkpoint_digest(model_path: str | Path) -> str:
    """``sha256:<64 hex>`` of the files described in the module docstring.

    Raises:
        OSError: the directory or a file cannot be read.
        ValueError: a ``.safetensors`` file is shorter than its declared header.
    """
    root = Path(model_path)
    digest = hashlib.sha256()
    for name in _WHOLE_FILES:
        path = root / name
        if path.is_file():
            digest.update(f"file {name}\n".encode())
            digest.update(path.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: {size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{path}: header length {length} exceeds the file ({size} bytes)")
            header = f.read(length)
            digest.update(f"safetensors {path.name} {size}\n".encode())
            digest.update(prefix + header)
            start, data = 8 + length, size - 8 - length
            for offset in sorted(
                {
                    start,
                    start + max(0, data // 2 - SAMPLE_BYTES // 2),
                    start + max(0, data - SAMPLE_BYTES),
                }
            ):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return f"sha256:{digest.hexdigest()}"
