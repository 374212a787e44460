"""A tiny embedding checkpoint in Qwen3-Embedding's layout, for tests and the docs' examples.

What it writes is what a sentence-transformers embedding model on the hub holds: base-model
weights saved by ``transformers.AutoModel`` (``embed_tokens.weight``, ``layers.0...``, no LM
head) under a ``config.json`` that names the causal-LM architecture (Qwen3-Embedding's
``Qwen3ForCausalLM``; ``base_architecture=True`` keeps ``Qwen3Model``), the tokenizer, and the
sentence-transformers module files in their long-standing spelling: ``modules.json``,
``1_Pooling/config.json`` (one ``pooling_mode_*`` flag), ``2_Normalize/`` when normalising, and
``sentence_bert_config.json``. ``SentenceTransformer(out_dir)`` loads it as it is.

Command line::

    python -m shardline_runtime.tiny_embedding_checkpoint OUT_DIR [--pooling lasttoken|mean|cls]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardline_runtime.tiny_checkpoint import tiny_config, train_tokenizer

_LEGACY_FLAGS = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")


def make_tiny_embedding_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3",
    pooling: str = "lasttoken",
    normalize: bool = True,
    seed: int = 0,
    base_architecture: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random embedding model of ``arch`` (a dense one of ``tiny_config``) to ``out_dir``.

    Args:
        pooling: ``lasttoken``, ``mean`` or ``cls``.
        normalize: add the ``Normalize`` module (unit-length embeddings).
        base_architecture: keep ``config.json``'s base-model name (``Qwen3Model``).
        overrides: passed to :func:`tiny_config` (``is_matryoshka=True`` marks the model as
            trained for ``dimensions``).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: an unknown ``pooling``.
    """
    import torch
    import transformers

    if pooling not in _LEGACY_FLAGS:
        raise ValueError(f"pooling must be one of {list(_LEGACY_FLAGS)}, got {pooling!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if not base_architecture:
        cfg_file = out / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["architectures"] = [cfg["architectures"][0].removesuffix("Model") + "ForCausalLM"]
        cfg_file.write_text(json.dumps(cfg, indent=2))
    train_tokenizer(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    flags = {f"pooling_mode_{m}": False for m in _MODES}
    flags[f"pooling_mode_{_LEGACY_FLAGS[pooling]}"] = True
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, **flags}, indent=2)
    )
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": config.max_position_embeddings, "do_lower_case": False})
    )
    for written in out.rglob("*"):
        if written.is_file():
            written.chmod(written.stat().st_mode | 0o444)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--pooling", default="lasttoken", choices=list(_LEGACY_FLAGS))
    parser.add_argument("--no-normalize", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_embedding_checkpoint(
        args.out_dir, args.arch, args.pooling, not args.no_normalize, args.seed
    )


if __name__ == "__main__":
    main()
