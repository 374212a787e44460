"""Find and check a checkpoint's safetensors files, and iterate its tensors.

Layouts: one ``model.safetensors``; or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file); or, without an index, every ``*.safetensors`` file.
Each file's header is read (8-byte little-endian length + JSON) to check, before any tensor is
read, that the file exists, is complete (its size covers the last tensor's end offset) and
holds the tensors the index assigns to it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from shardline_runtime.model_loader.errors import CheckpointError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype strings the loader reads (quantized checkpoints add FP8 and packed ints)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one stored tensor: safetensors dtype string and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check the file holds every byte it declares.

    Raises:
        CheckpointError: missing, unreadable, or truncated file (names it).
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint shard {path} is missing")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"checkpoint shard {path} is truncated ({size} bytes, no header)"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            if 8 + header_len > size:
                raise CheckpointError(
                    f"checkpoint shard {path} is truncated: header of {header_len} bytes, file {size} bytes"
                )
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        hint = ""
        if isinstance(e, PermissionError):
            # A model volume written by another user (save_pretrained writes shards 0600).
            hint = (
                f"; this process runs as uid {os.getuid()} gid {os.getgid()}: make the "
                f"checkpoint readable by it (e.g. chmod -R a+rX {path.parent})"
            )
        raise CheckpointError(f"checkpoint shard {path} is unreadable: {e}{hint}") from None
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"checkpoint shard {path} is truncated: tensors need {8 + header_len + end} bytes, file has {size}"
        )
    return {
        name: TensorInfo(path, info["dtype"], tuple(info["shape"])) for name, info in header.items()
    }


def discover_checkpoint(model_path: str | Path) -> dict[str, TensorInfo]:
    """Map every tensor of the checkpoint at ``model_path`` to its file, dtype and shape.

    A ``*.safetensors`` file the index does not list is ignored with a warning.

    Raises:
        CheckpointError: no safetensors file; a listed shard missing or truncated; a tensor the
            index names absent from its shard; a tensor stored twice.
    """
    root = Path(model_path)
    index = root / INDEX_FILE
    present = sorted(root.glob("*.safetensors"))
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"{index} is not a valid safetensors index (needs 'weight_map'): {e}"
            ) from None
        listed = sorted(set(weight_map.values()))
        for stray in sorted({p.name for p in present} - set(listed)):
            logger.warning("ignoring %s: not listed in %s", root / stray, INDEX_FILE)
        headers = {f: read_header(root / f) for f in listed}
        tensors: dict[str, TensorInfo] = {}
        for name, f in weight_map.items():
            if name not in headers[f]:
                raise CheckpointError(
                    f"{INDEX_FILE} puts {name!r} in {root / f}, which does not contain it"
                )
            tensors[name] = headers[f][name]
        return tensors
    if not present:
        raise CheckpointError(f"{root}: no *.safetensors files and no {INDEX_FILE}")
    tensors = {}
    for path in present:
        for name, info in read_header(path).items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r} is stored in both {tensors[name].file} and {path}"
                )
            tensors[name] = info
    return tensors


def iterate_weights(tensors: dict[str, TensorInfo]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` file by file (each file opened once, memory-mapped)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, info in tensors.items():
        by_file.setdefault(info.file, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types on corrupt data
            raise CheckpointError(f"cannot read {path}: {e}") from None
