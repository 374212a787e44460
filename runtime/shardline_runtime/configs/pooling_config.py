"""PoolingConfig: how an embedding model turns hidden states into one vector per input.

A checkpoint is an embedding model when it carries the sentence-transformers module files
(what ``SentenceTransformer.save`` writes, and what Qwen3-Embedding, BGE, E5 and GTE ship):
``modules.json`` lists the modules in order (a ``Transformer``, a ``Pooling`` whose directory
holds ``config.json``, optionally a ``Normalize`` that makes the vectors unit length). Both
spellings are read: sentence-transformers < 6 (``sentence_transformers.models.Pooling``, one
``pooling_mode_*`` flag set, ``word_embedding_dimension``) and >= 6
(``sentence_transformers.sentence_transformer.modules.pooling.Pooling``, ``pooling_mode``,
``embedding_dimension``). Without ``modules.json`` the checkpoint is a generation model.
Matryoshka truncation (``dimensions`` in ``/v1/embeddings``) is allowed when ``config.json``
says the model was trained for it: ``is_matryoshka: true`` or a ``matryoshka_dimensions`` list
(vLLM's fields).

Supported pooling: ``lasttoken``, ``mean``, ``cls``; every other module or mode is refused at
startup, naming the file and the field, never served with a different meaning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

_MODULES = ("Transformer", "Pooling", "Normalize")  # the class names, in either spelling
# sentence-transformers < 6 flags -> the >= 6 mode names
_LEGACY_MODES = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "lasttoken"}


class PoolingType(str, Enum):
    """Which hidden states make the embedding (sentence-transformers' ``pooling_mode_*``)."""

    LAST = (
        "lasttoken"  # the last token's hidden state (decoder models: Qwen3-Embedding, E5-Mistral)
    )
    MEAN = "mean"  # the mean over every token of the input
    CLS = "cls"  # the first token's hidden state


# --model-kind: what a deployment declares it serves (auto: whatever the checkpoint is)
MODEL_KINDS = ("auto", "generate", "embed")


def model_kind(pooling: PoolingConfig | None) -> str:
    """``embed`` for an embedding model (a pooling config), else ``generate``."""
    return "generate" if pooling is None else "embed"


def model_kind_problem(requested: str, pooling: PoolingConfig | None) -> str | None:
    """Why a checkpoint cannot serve as ``--model-kind requested``, or None."""
    found = model_kind(pooling)
    if requested in ("auto", found):
        return None
    what = "an embedding model (it has" if found == "embed" else "a generation model (it has no"
    return (
        f"--model-kind {requested}: the checkpoint is {what} sentence-transformers "
        f"modules.json); allowed: {list(MODEL_KINDS)}"
    )


def add_model_kind_argument(group: Any, default: str) -> None:
    """Add ``--model-kind`` to ``group`` (an argparse group of ``make_parser``)."""
    group.add_argument(
        "--model-kind",
        default=default,
        choices=MODEL_KINDS,
        help="What the server serves: generate (a causal LM), embed (an embedding model: a "
        "checkpoint with sentence-transformers' modules.json, served at /v1/embeddings), or "
        "auto: whichever the checkpoint is. A checkpoint of the other kind refuses to start.",
    )


class PoolingConfigError(ValueError):
    """The sentence-transformers files ask for something not served; the message names it."""


@dataclass(frozen=True)
class PoolingConfig:
    """An embedding model's pooling, read by :func:`read_pooling_config`.

    Attributes:
        pooling_type: how the (T, hidden) states of one input become one (hidden,) vector.
        normalize: L2-normalise the pooled vector (a ``Normalize`` module follows the pooling).
        dimensions: the width of a full embedding (``hidden_size``).
        matryoshka_dimensions: widths the model allows in ``dimensions``: an explicit list, every
            width 1..``dimensions`` (``is_matryoshka``), or empty (no truncation allowed).
    """

    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    matryoshka_dimensions: tuple[int, ...] = ()

    def dimensions_problem(self, dimensions: int) -> str | None:
        """Why an embedding cannot be cut to ``dimensions`` values, or None when it can."""
        if not self.matryoshka_dimensions:
            return (
                "this model was not trained for Matryoshka truncation (config.json has no "
                "is_matryoshka / matryoshka_dimensions); leave dimensions out"
            )
        if dimensions not in self.matryoshka_dimensions:
            allowed = self.matryoshka_dimensions
            listed = (
                f"1 to {self.dimensions}"
                if allowed == tuple(range(1, self.dimensions + 1))
                else list(allowed)
            )
            return f"dimensions must be one of {listed}, got {dimensions}"
        return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PoolingConfigError(f"{path}: cannot read: {e}") from None


def _pooling_type(path: Path, cfg: dict) -> PoolingType:
    mode = cfg.get("pooling_mode")
    if mode is None:  # sentence-transformers < 6: one pooling_mode_* flag
        flags = [
            k.removeprefix("pooling_mode_")
            for k, on in cfg.items()
            if k.startswith("pooling_mode_") and on is True
        ]
        mode = [_LEGACY_MODES.get(f, f) for f in flags]
    modes = [mode] if isinstance(mode, str) else list(mode)
    allowed = [t.value for t in PoolingType]
    if len(modes) != 1 or modes[0] not in allowed:
        raise PoolingConfigError(
            f"{path}: pooling_mode {modes} is not supported; supported: one of {allowed}"
        )
    if cfg.get("include_prompt", True) is not True:
        raise PoolingConfigError(f"{path}: include_prompt false is not supported")
    return PoolingType(modes[0])


def _matryoshka(cfg: dict, hidden_size: int, source: str) -> tuple[int, ...]:
    listed = cfg.get("matryoshka_dimensions")
    if listed is not None:
        if not isinstance(listed, list) or not all(
            isinstance(d, int) and 0 < d <= hidden_size for d in listed
        ):
            raise PoolingConfigError(
                f"{source}: matryoshka_dimensions must be a list of integers in 1..{hidden_size}"
            )
        return tuple(sorted(set(listed)))
    if cfg.get("is_matryoshka") is True:
        return tuple(range(1, hidden_size + 1))
    return ()


def _module_class(module: Any) -> str | None:
    """``Pooling`` for ``sentence_transformers.[...].Pooling``; None for anything else."""
    kind = module.get("type") if isinstance(module, dict) else None
    if not isinstance(kind, str) or not kind.startswith("sentence_transformers."):
        return None
    return kind.rsplit(".", 1)[-1]


def read_pooling_config(
    model_path: str | Path, cfg: dict, hidden_size: int
) -> PoolingConfig | None:
    """The pooling of the checkpoint at ``model_path`` (``cfg``: its parsed ``config.json``), or
    None for a generation model (no ``modules.json``).

    Raises:
        PoolingConfigError: an unreadable file, a module other than Transformer / Pooling /
            Normalize (a ``Dense`` projection, say), not exactly one Pooling module, a pooling
            mode not listed in :class:`PoolingType`, a pooled width other than
            ``hidden_size``, or a bad ``matryoshka_dimensions``.
    """
    root = Path(model_path)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{modules_file}: must be a list of modules")
    types = [_module_class(m) for m in modules]
    unknown = [m for m, t in zip(modules, types) if t not in _MODULES]
    if unknown:
        raise PoolingConfigError(
            f"{modules_file}: module {unknown[0]!r} is not supported; supported: "
            f"sentence-transformers' {list(_MODULES)}"
        )
    if types.count("Pooling") != 1:
        raise PoolingConfigError(f"{modules_file}: needs exactly one Pooling module")
    position = types.index("Pooling")
    pooling_file = root / modules[position].get("path", "") / "config.json"
    pooling_cfg = _read_json(pooling_file)
    width = pooling_cfg.get("embedding_dimension", pooling_cfg.get("word_embedding_dimension"))
    if width not in (None, hidden_size):
        raise PoolingConfigError(
            f"{pooling_file}: embedding_dimension {width} differs from hidden_size {hidden_size}"
        )
    return PoolingConfig(
        pooling_type=_pooling_type(pooling_file, pooling_cfg),
        normalize="Normalize" in types[position + 1 :],
        dimensions=hidden_size,
        matryoshka_dimensions=_matryoshka(cfg, hidden_size, str(root / "config.json")),
    )
