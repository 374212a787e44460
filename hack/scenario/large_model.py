"""A ~200M-parameter float32 Llama in two revisions, written once into the cache and reused.

For rollouts where loading takes seconds (``bench/rollout.py --params-200m`` and the e2e
``tests/e2e/test_rollout_200m.py``): 12 layers x (4 x 1024^2 attention + 3 x 1024 x 4096 MLP)
plus two 512 x 1024 embeddings, 202.4M parameters, an 810 MB ``model.safetensors`` per revision.

The weights are random and nobody reads their answers, so they are drawn straight into
safetensors with a seeded ``torch.Generator`` (N(0, 0.02) like HuggingFace's
``initializer_range`` default, norms at 1), not built through a ``transformers`` model and its
per-module init: the parameter names and shapes come from the model class on the ``meta``
device, so the files are what ``save_pretrained`` writes for this config. ``config.json`` and
the tokenizer come from ``shardline_runtime.tiny_checkpoint``.

The revisions live under ``~/.cache/shardline/llama-200m-<key>/`` (``SHARDLINE_CACHE`` moves the
root; ``<key>`` hashes :data:`RECIPE`), each written to a temporary sibling and renamed into
place, and are hard-linked (copied across filesystems) into the models hostPath that pods mount.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hack.localcluster.build import cache_root
from hack.scenario.models import MODELS_ROOT

# Everything that changes the files is here; its hash names the cache directory.
RECIPE: dict[str, Any] = {
    "arch": "llama", "vocab_size": 512, "std": 0.02, "writer": 2,
    "config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
               "num_attention_heads": 16, "num_key_value_heads": 16},
    "seeds": {"rev-a": 1, "rev-b": 2},
}


def cache_dir() -> Path:
    """``<cache root>/llama-200m-<first 12 hex of sha256(RECIPE)>``."""
    key = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"llama-200m-{key}"


def write_checkpoint(out: Path, seed: int) -> Path:
    """Write config, tokenizer and seeded random float32 weights (one ``model.safetensors``)
    into ``out`` (created). Same ``seed``, same bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from shardline_runtime.tiny_checkpoint import tiny_config, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(RECIPE["arch"], vocab_size=RECIPE["vocab_size"], **RECIPE["config"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    config.architectures = [type(model).__name__]  # what save_pretrained records
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.empty(shape).normal_(0.0, RECIPE["std"], generator=generator)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    train_tokenizer(out, vocab_size=RECIPE["vocab_size"])
    return out


def _cached(name: str) -> Path:
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write_checkpoint(tmp, RECIPE["seeds"][name])
        tmp.chmod(0o755)
        tmp.rename(target)
    except OSError:  # another session won the race; its copy is identical
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link (or copy, across filesystems) every file of ``source`` into a temporary sibling
    of ``target``, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for f in source.iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
        tmp.chmod(0o755)
        tmp.rename(target)
    except OSError:  # another session won the race with the same files
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def large_revisions(root: Path = MODELS_ROOT) -> dict[str, Path]:
    """``{"rev-a": path, "rev-b": path}`` under ``<root>/<cache dir name>/``, written into the
    cache on first use (about 10 s of CPU and 1.6 GB of disk) and linked from there."""
    base = root / cache_dir().name
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in RECIPE["seeds"]:
        target = base / name
        if not (target / "config.json").is_file():
            _link_tree(_cached(name), target)
        out[name] = target
    return out


if __name__ == "__main__":
    import time

    started = time.monotonic()
    print(large_revisions(), f"{time.monotonic() - started:.1f}s")
