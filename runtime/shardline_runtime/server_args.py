"""Server arguments: the validated arguments of ``shardline-runtime serve``, in frozen sections.

Flag names follow ``sglang.launch_server`` where the concept is the same (``--model-path``,
``--tp-size``, ``--pp-size``, ``--nnodes``, ``--node-rank``, ``--dist-init-addr``, ``--mem-fraction-static``,
``--max-total-tokens``, ``--chunked-prefill-size``, ``--cuda-graph-max-bs`` ...), so a user of
SGLang can read a Shardline pod spec without a table. The operator renders its container
arguments with one function and a contract test parses them with :func:`make_parser`
(``server_args_parser.py``).

:class:`ServerArgs` holds one frozen section per concern (``server_args_sections.py``:
``model``, ``http``, ``parallel``, ``memory``, ``schedule``, ``experts``, ``graphs``, ``lora``,
``operation``, ``weight_sync``); the runner and the scheduler take sections, and every field
also reads flat (``args.tp_size`` is ``args.parallel.tp_size``). Validation happens in two
places: per-flag ranges in the parser and cross-field rules in the constructor (raising
:class:`ServerArgsError`, a ``ValueError``).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

from shardline_runtime.server_args_graphs import torch_compile_errors
from shardline_runtime.server_args_parser import ADMIN_API_KEY_ENV, API_KEY_ENV, make_parser
from shardline_runtime.server_args_sections import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    SECTION_OF,
    SECTIONS,
    ExpertArgs,
    GraphArgs,
    HTTPArgs,
    LoRAArgs,
    MemoryArgs,
    ModelArgs,
    OperationArgs,
    ParallelArgs,
    ScheduleArgs,
    WeightSyncArgs,
)
from shardline_runtime.speculative.spec_args import SpeculativeArgs, speculative_errors

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "KV_CACHE_DTYPES",
    "ServerArgs",
    "ServerArgsError",
    "make_parser",
]

# One key or several separated by commas (rotation); each printable ASCII without spaces.
_API_KEY = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,4096}(,[\x21-\x2b\x2d-\x7e]{1,4096})*$")


class ServerArgsError(ValueError):
    """A server argument (or a combination of them) is invalid; the message names the flag."""


class ServerArgs:
    """Validated arguments of one runtime process group (one pod), as frozen sections.

    Built from flat keyword arguments (the flags' names with underscores: ``ServerArgs(
    model_path="/m", tp_size=2)``); each field reads flat or through its section.

    Units: ports are TCP ports, ``dist_timeout``, ``watchdog_timeout``, ``drain_timeout`` and
    ``weight_update_hold_timeout`` are seconds, token counts are tokens. ``None`` means "derive it":
    ``max_total_tokens`` from the memory budget, ``context_length`` from the model config,
    ``served_model_name`` from ``model_path``, ``tokenizer_path`` = ``model_path``.

    Raises:
        TypeError: an unknown field name.
        ServerArgsError: a cross-field rule is broken (e.g. ``tp_size * pp_size`` not divisible
            by ``nnodes``, ``node_rank >= nnodes``, ``nnodes > 1`` without ``dist_init_addr``).
    """

    __slots__ = tuple(SECTIONS)
    model: ModelArgs
    http: HTTPArgs
    parallel: ParallelArgs
    memory: MemoryArgs
    schedule: ScheduleArgs
    experts: ExpertArgs
    graphs: GraphArgs
    lora: LoRAArgs
    operation: OperationArgs
    weight_sync: WeightSyncArgs
    speculative: SpeculativeArgs

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"ServerArgs got unknown fields {unknown}")
        if not values.get("model_path"):
            raise ServerArgsError("--model-path is required and must be a non-empty directory path")
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            by_section[SECTION_OF[name]][name] = value
        from shardline_runtime.configs.pipeline_stage import PipelineLayoutError

        raw = by_section.pop("parallel")
        layout_error = None
        try:
            parallel = ParallelArgs.resolve(**raw)
        except PipelineLayoutError as e:  # reported after the world-size rule, as it always was
            layout_error = str(e)
            parallel = ParallelArgs.resolve(**{**raw, "pp_layer_partition": ()})
        object.__setattr__(self, "parallel", parallel)
        for name, section in SECTIONS.items():
            if name != "parallel":
                resolve = getattr(section, "resolve", section)
                object.__setattr__(self, name, resolve(**by_section[name]))
        _check(self, bool(values.get("enable_lora") or values.get("lora_paths")), layout_error)

    def __getattr__(self, name: str) -> Any:
        section = SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"ServerArgs has no field {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ServerArgs is frozen: cannot set {name!r}")

    def __getstate__(self) -> dict[str, Any]:  # pickled to the scheduler processes
        return {name: getattr(self, name) for name in SECTIONS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, section in state.items():
            object.__setattr__(self, name, section)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerArgs) and self.flat() == other.flat()

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, s) for s in SECTIONS))

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for s, cls in SECTIONS.items()
            for f in fields(cls)
            if f.repr
        ]
        return f"ServerArgs({', '.join(shown)})"

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (secrets included)."""
        return {k: v for s in SECTIONS for k, v in asdict(getattr(self, s)).items()}

    def replace(self, **changes: Any) -> ServerArgs:
        """A validated copy with ``changes`` (flat names)."""
        return ServerArgs(**{**self.flat(), **changes})

    @property
    def world_size(self) -> int:
        """Ranks of one model replica: ``tp_size * pp_size``."""
        return self.parallel.world_size

    @property
    def tp_size_per_node(self) -> int:
        """Number of ranks (scheduler processes) this node runs: ``tp_size * pp_size / nnodes``."""
        return self.world_size // self.parallel.nnodes

    @property
    def model_name(self) -> str:
        """The OpenAI ``model`` name: ``served_model_name`` or ``model_path``."""
        return self.model.served_model_name or self.model.model_path

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> ServerArgs:
        """Parse ``argv`` (without the ``serve`` subcommand) into validated ``ServerArgs``.

        Raises:
            SystemExit: (code 2) a flag is unknown or out of range (argparse prints why).
            ServerArgsError: a cross-field rule is broken.
        """
        namespace = make_parser().parse_args(argv)
        return cls.from_namespace(namespace)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> ServerArgs:
        """Build ``ServerArgs`` from the namespace returned by :func:`make_parser`."""
        values = {k: v for k, v in vars(namespace).items() if k in SECTION_OF}
        # Keys come from the environment unless given as flags (a flag shows in ``ps``; an env
        # var filled from a Secret does not). Surrounding whitespace (a Secret written from a file
        # with a final newline) is dropped; an empty value means "no key".
        for name, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
            values[name] = (values.get(name) or os.environ.get(env) or "").strip() or None
        return cls(**values)


def _check(args: ServerArgs, raw_lora: bool, layout_error: str | None) -> None:
    """The cross-field rules, in the order their messages are reported."""
    par, lora = args.parallel, args.lora
    if par.world_size % par.nnodes != 0:
        raise ServerArgsError(
            f"--tp-size x --pp-size ({par.tp_size} x {par.pp_size} = {par.world_size}) must be divisible by "
            f"--nnodes ({par.nnodes}): every node runs tp_size * pp_size / nnodes ranks"
        )
    if layout_error is not None:
        raise ServerArgsError(layout_error)
    if par.pp_layer_partition and len(par.pp_layer_partition) != par.pp_size:
        raise ServerArgsError(
            f"--pp-layer-partition gives {len(par.pp_layer_partition)} stages but --pp-size is {par.pp_size}"
        )
    if par.pp_size > 1 and raw_lora:
        raise ServerArgsError(
            "--enable-lora / --lora-paths is not supported with --pp-size > 1; use --pp-size 1"
        )
    if not 0 <= par.node_rank < par.nnodes:
        raise ServerArgsError(
            f"--node-rank must be in [0, {par.nnodes - 1}] for --nnodes {par.nnodes}, got {par.node_rank}"
        )
    if par.tp_size % par.ep_size != 0:
        raise ServerArgsError(
            f"--ep-size ({par.ep_size}) must divide --tp-size ({par.tp_size}): experts are split over "
            "ep_size groups of tp_size / ep_size ranks"
        )
    if par.nnodes > 1 and not par.dist_init_addr:
        raise ServerArgsError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
    _check_lora(lora, (args.model_name, args.model.model_path))
    errors = speculative_errors(args.speculative, par.pp_size, lora.enable_lora)
    errors += torch_compile_errors(args)
    if errors:
        raise ServerArgsError("; ".join(errors))
    model = args.model
    if model.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ServerArgsError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {model.kv_cache_dtype!r}"
        )
    if model.attention_backend not in ATTENTION_BACKENDS:
        raise ServerArgsError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {model.attention_backend!r}"
        )
    if args.graphs.piecewise_cuda_graph_max_tokens < 1:
        raise ServerArgsError(
            f"--piecewise-cuda-graph-max-tokens must be >= 1, got {args.graphs.piecewise_cuda_graph_max_tokens}"
        )
    for flag, key in (
        ("--api-key", args.http.api_key),
        ("--admin-api-key", args.http.admin_api_key),
    ):
        if key is not None and not _API_KEY.match(key):
            raise ServerArgsError(
                f"{flag} must be one key, or several separated by commas, of 1-4096 "
                "printable ASCII characters without spaces or commas (sent in an HTTP header)"
            )


def _check_lora(lora: LoRAArgs, base_names: tuple[str, ...]) -> None:
    from shardline_runtime.lora.lora_config import parse_lora_paths, resolve_target_modules

    try:
        paths = parse_lora_paths(list(lora.lora_paths))
        resolve_target_modules(list(lora.lora_target_modules))
    except ValueError as e:
        raise ServerArgsError(str(e)) from None
    for name in paths:
        if name in base_names:
            raise ServerArgsError(
                f"--lora-paths name {name!r} is the served model's name: an adapter needs a name "
                f"other than {sorted(set(base_names))} (requests for that name reach the base model)"
            )
    if len(paths) > lora.max_loras_per_batch:
        raise ServerArgsError(
            f"--lora-paths names {len(paths)} adapters but --max-loras-per-batch is {lora.max_loras_per_batch}"
        )
