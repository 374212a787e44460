"""Server arguments: the one command-line parser of ``shardline-runtime serve``.

Flag names follow ``sglang.launch_server`` where the concept is the same (``--model-path``,
``--tp-size``, ``--pp-size``, ``--nnodes``, ``--node-rank``, ``--dist-init-addr``, ``--mem-fraction-static``,
``--max-total-tokens``, ``--chunked-prefill-size``, ``--cuda-graph-max-bs`` ...), so a user of
SGLang can read a Shardline pod spec without a table. The operator renders its container
arguments with one function and a contract test parses them with :func:`make_parser`.

Validation happens in two places: per-flag ranges in the argparse ``type`` functions (so
``--port 0`` fails with ``argument --port: must be in [1, 65535], got 0``) and cross-field rules
in :meth:`ServerArgs.__post_init__` (raising :class:`ServerArgsError`, a ``ValueError``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOAD_FORMATS = ("auto", "safetensors")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton")
RECORDER_MODES = ("stat", "per_pass")
API_KEY_ENV = "SHARDLINE_API_KEY"
ADMIN_API_KEY_ENV = "SHARDLINE_ADMIN_API_KEY"
# One key or several separated by commas (rotation); each printable ASCII without spaces.
_API_KEY = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,4096}(,[\x21-\x2b\x2d-\x7e]{1,4096})*$")


class ServerArgsError(ValueError):
    """A server argument (or a combination of them) is invalid; the message names the flag."""


def _int_range(flag: str, low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            lo = "-inf" if low is None else low
            hi = "inf" if high is None else high
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = flag
    return parse


def _float_range(flag: str, low: float, high: float, low_open: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if too_low or value > high or value != value:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low}, {high}], got {text}")
        return value

    parse.__name__ = flag
    return parse


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT with PORT in [1, 65535] (e.g. name-g0-0.name-g0-ranks.ns.svc:29500), got {text!r}"
        )
    return text


@dataclass(frozen=True)
class ServerArgs:
    """Validated arguments of one runtime process group (one pod).

    Units: ports are TCP ports, ``dist_timeout``, ``watchdog_timeout``, ``drain_timeout`` and
    ``weight_update_hold_timeout`` are seconds, token counts are tokens. ``None`` means "derive it":
    ``max_total_tokens`` from the memory budget, ``context_length`` from the model config,
    ``served_model_name`` from ``model_path``, ``tokenizer_path`` = ``model_path``.

    Raises:
        ServerArgsError: a cross-field rule is broken (e.g. ``tp_size * pp_size`` not divisible
            by ``nnodes``, ``node_rank >= nnodes``, ``nnodes > 1`` without ``dist_init_addr``).
    """

    model_path: str
    served_model_name: str | None = None
    revision: str | None = None
    tokenizer_path: str | None = None
    load_format: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    tp_size: int = 1
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] = ()
    ep_size: int = 1
    ep_num_redundant_experts: int = 0
    eplb_rebalance_num_iterations: int = 0
    expert_distribution_recorder_mode: str = "stat"
    expert_distribution_recorder_dir: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    context_length: int | None = None
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    disable_overlap_schedule: bool = False
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 4096
    random_seed: int = 0
    log_level: str = "info"
    dist_timeout: int = 600
    watchdog_timeout: int = 300
    drain_timeout: int = 30
    weight_update_hold_timeout: int = 60
    weight_version: str = "default"
    enable_weights_cpu_backup: bool = False
    enable_memory_saver: bool = False
    # Secrets: kept out of repr() so a logged ServerArgs never shows them.
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ServerArgsError("--model-path is required and must be a non-empty directory path")
        if self.world_size % self.nnodes != 0:
            raise ServerArgsError(
                f"--tp-size x --pp-size ({self.tp_size} x {self.pp_size} = {self.world_size}) must be divisible by "
                f"--nnodes ({self.nnodes}): every node runs tp_size * pp_size / nnodes ranks"
            )
        self._check_pipeline()
        if not 0 <= self.node_rank < self.nnodes:
            raise ServerArgsError(
                f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}, got {self.node_rank}"
            )
        if self.tp_size % self.ep_size != 0:
            raise ServerArgsError(
                f"--ep-size ({self.ep_size}) must divide --tp-size ({self.tp_size}): experts are split over "
                "ep_size groups of tp_size / ep_size ranks"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ServerArgsError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        self._check_lora()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ServerArgsError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ServerArgsError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.piecewise_cuda_graph_max_tokens < 1:
            raise ServerArgsError(
                f"--piecewise-cuda-graph-max-tokens must be >= 1, got {self.piecewise_cuda_graph_max_tokens}"
            )
        for flag, key in (("--api-key", self.api_key), ("--admin-api-key", self.admin_api_key)):
            if key is not None and not _API_KEY.match(key):
                raise ServerArgsError(
                    f"{flag} must be one key, or several separated by commas, of 1-4096 "
                    "printable ASCII characters without spaces or commas (sent in an HTTP header)"
                )
        if self.chunked_prefill_size > self.max_prefill_tokens and self.max_prefill_tokens > 0:
            object.__setattr__(self, "max_prefill_tokens", self.chunked_prefill_size)

    def _check_pipeline(self) -> None:
        from shardline_runtime.configs.pipeline_stage import (
            PipelineLayoutError,
            parse_layer_partition,
        )

        partition = self.pp_layer_partition
        if isinstance(partition, str):
            try:
                partition = parse_layer_partition(partition)
            except PipelineLayoutError as e:
                raise ServerArgsError(str(e)) from None
        object.__setattr__(self, "pp_layer_partition", tuple(partition or ()))
        if self.pp_layer_partition and len(self.pp_layer_partition) != self.pp_size:
            raise ServerArgsError(
                f"--pp-layer-partition gives {len(self.pp_layer_partition)} stages but --pp-size is {self.pp_size}"
            )
        if self.pp_size > 1 and (self.enable_lora or self.lora_paths):
            raise ServerArgsError(
                "--enable-lora / --lora-paths is not supported with --pp-size > 1; use --pp-size 1"
            )

    def _check_lora(self) -> None:
        from shardline_runtime.lora.lora_config import parse_lora_paths, resolve_target_modules

        object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules or ()))
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(
                self, "enable_lora", True
            )  # --lora-paths implies --enable-lora, as in SGLang
        try:
            paths = parse_lora_paths(list(self.lora_paths))
            resolve_target_modules(list(self.lora_target_modules))
        except ValueError as e:
            raise ServerArgsError(str(e)) from None
        if len(paths) > self.max_loras_per_batch:
            raise ServerArgsError(
                f"--lora-paths names {len(paths)} adapters but --max-loras-per-batch is {self.max_loras_per_batch}"
            )

    @property
    def world_size(self) -> int:
        """Ranks of one model replica: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    @property
    def tp_size_per_node(self) -> int:
        """Number of ranks (scheduler processes) this node runs: ``tp_size * pp_size / nnodes``."""
        return self.world_size // self.nnodes

    @property
    def model_name(self) -> str:
        """The OpenAI ``model`` name: ``served_model_name`` or ``model_path``."""
        return self.served_model_name or self.model_path

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
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(namespace).items() if k in names}
        # Keys come from the environment unless given as flags (a flag shows in ``ps``; an env
        # var filled from a Secret does not). Surrounding whitespace (a Secret written from a file
        # with a final newline) is dropped; an empty value means "no key".
        for name, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
            values[name] = (values.get(name) or os.environ.get(env) or "").strip() or None
        return cls(**values)


def make_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """Return the argument parser of ``shardline-runtime serve`` (flags only, no subcommand)."""
    p = argparse.ArgumentParser(
        prog="shardline-runtime serve",
        description="Serve a model with Shardline's tensor-parallel runtime (OpenAI-compatible HTTP API).",
        add_help=add_help,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # "--pp-s 1" in spec.runtime.args must not override the rendered --pp-size
    )
    d = ServerArgs.__dataclass_fields__

    def default(name: str):
        return d[name].default

    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        required=True,
        help="Directory with config.json, *.safetensors and the tokenizer.",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients pass as the OpenAI 'model' field (default: --model-path).",
    )
    m.add_argument(
        "--revision",
        default=None,
        help="Label of the checkpoint revision, reported by /get_server_info and /metrics.",
    )
    m.add_argument(
        "--tokenizer-path", default=None, help="Tokenizer directory (default: --model-path)."
    )
    m.add_argument(
        "--load-format",
        default=default("load_format"),
        choices=LOAD_FORMATS,
        help="Checkpoint format.",
    )
    m.add_argument(
        "--dtype",
        default=default("dtype"),
        choices=DTYPES,
        help="Weight and activation dtype; auto takes config.json's torch_dtype (float32 on CPU for half types).",
    )
    m.add_argument(
        "--kv-cache-dtype",
        default=default("kv_cache_dtype"),
        choices=KV_CACHE_DTYPES,
        help="KV cache storage dtype; auto: the model dtype. fp8 types store K/V divided by per-layer k_scale/v_scale (1.0, or the checkpoint's).",
    )
    m.add_argument(
        "--attention-backend",
        default=default("attention_backend"),
        choices=ATTENTION_BACKENDS,
        help="Attention kernels; auto: triton on CUDA, torch_native on CPU.",
    )
    m.add_argument(
        "--context-length",
        type=_int_range("--context-length", 1),
        default=None,
        help="Maximum tokens per request (prompt + output); default: the model's max_position_embeddings.",
    )

    h = p.add_argument_group("HTTP server")
    h.add_argument(
        "--host", default=default("host"), help="Address to bind exactly (in a pod: $(POD_IP))."
    )
    h.add_argument(
        "--port",
        type=_int_range("--port", 1, 65535),
        default=default("port"),
        help="HTTP port (rank>0 nodes serve /health and /ready on it).",
    )
    h.add_argument(
        "--api-key",
        default=None,
        help=f"Key of the serving endpoints (Authorization: Bearer); default: ${API_KEY_ENV}. Without any key every endpoint is open.",
    )
    h.add_argument(
        "--admin-api-key",
        default=None,
        help=f"Key of the control endpoints (weight updates, cache flush, aborts, every endpoint not listed as serving or open); default: ${ADMIN_API_KEY_ENV}, else the API key.",
    )

    d_ = p.add_argument_group("parallelism")
    d_.add_argument(
        "--tp-size",
        type=_int_range("--tp-size", 1),
        default=default("tp_size"),
        help="Tensor-parallel size across all nodes.",
    )
    d_.add_argument(
        "--pp-size",
        type=_int_range("--pp-size", 1),
        default=default("pp_size"),
        help="Pipeline-parallel stages: each runs a contiguous range of the layers on tp_size ranks; the world is tp_size x pp_size ranks (rank = pp_rank * tp_size + tp_rank).",
    )
    d_.add_argument(
        "--pp-layer-partition",
        default=None,
        help="Layers per pipeline stage as a comma list (e.g. 10,11,11; --pp-size entries summing to the model's layers); default: an even split, the remainder on the stages before the last.",
    )
    d_.add_argument(
        "--ep-size",
        type=_int_range("--ep-size", 1),
        default=default("ep_size"),
        help="Expert-parallel size (MoE models): experts are split over this many groups of tp_size / ep_size ranks; must divide --tp-size.",
    )
    d_.add_argument(
        "--nnodes",
        type=_int_range("--nnodes", 1),
        default=default("nnodes"),
        help="Number of nodes (pods) of the model replica; node n runs world ranks n * k .. n * k + k - 1 with k = tp_size * pp_size / nnodes.",
    )
    d_.add_argument(
        "--node-rank",
        type=_int_range("--node-rank", 0),
        default=default("node_rank"),
        help="This node's rank in [0, nnodes); rank 0 serves the API.",
    )
    d_.add_argument(
        "--dist-init-addr",
        type=_host_port,
        default=None,
        help="HOST:PORT of node 0 for the torch.distributed rendezvous (required when --nnodes > 1).",
    )
    d_.add_argument(
        "--device",
        default=default("device"),
        choices=DEVICES,
        help="auto picks cuda when available, else cpu (gloo).",
    )
    d_.add_argument(
        "--dist-timeout",
        type=_int_range("--dist-timeout", 1),
        default=default("dist_timeout"),
        help="Seconds to wait for rendezvous and collectives before failing.",
    )

    mem = p.add_argument_group("memory and scheduling")
    mem.add_argument(
        "--mem-fraction-static",
        type=_float_range("--mem-fraction-static", 0.0, 1.0, True),
        default=default("mem_fraction_static"),
        help="Fraction of the GPU memory free before loading that weights + KV cache may take.",
    )
    mem.add_argument(
        "--max-total-tokens",
        type=_int_range("--max-total-tokens", 1),
        default=None,
        help="KV cache size in tokens (default: from the memory budget).",
    )
    mem.add_argument(
        "--max-running-requests",
        type=_int_range("--max-running-requests", 1),
        default=default("max_running_requests"),
        help="Maximum requests in the running batch.",
    )
    mem.add_argument(
        "--chunked-prefill-size",
        type=_int_range("--chunked-prefill-size", -1),
        default=default("chunked_prefill_size"),
        help="Maximum prompt tokens of one request per step; -1 or 0 disables chunking.",
    )
    mem.add_argument(
        "--max-prefill-tokens",
        type=_int_range("--max-prefill-tokens", 1),
        default=default("max_prefill_tokens"),
        help="Maximum prompt tokens of all requests in one prefill step.",
    )
    mem.add_argument(
        "--disable-radix-cache", action="store_true", help="Disable the prefix (radix) cache."
    )
    mem.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="Run the running requests' decode in the same forward as a prefill (one step instead of two).",
    )
    mem.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="Process each step's result before preparing the next step (default: the next step is prepared and launched while the current one computes; off with --enable-lora and with --pp-size > 1, whose micro-batches keep the stages busy instead).",
    )

    e = p.add_argument_group("experts (MoE models)")
    e.add_argument(
        "--ep-num-redundant-experts",
        type=_int_range("--ep-num-redundant-experts", 0),
        default=default("ep_num_redundant_experts"),
        help="Extra physical expert slots per MoE layer for EPLB replicas; num_experts + this must be divisible by --ep-size.",
    )
    e.add_argument(
        "--eplb-rebalance-num-iterations",
        type=_int_range("--eplb-rebalance-num-iterations", 0),
        default=default("eplb_rebalance_num_iterations"),
        help="Rebalance the experts (EPLB) every this many forward passes from the load seen since the last one; 0: only on POST /rebalance_experts.",
    )
    e.add_argument(
        "--expert-distribution-recorder-mode",
        default=default("expert_distribution_recorder_mode"),
        choices=RECORDER_MODES,
        help="Default mode of POST /start_expert_distribution_record: stat (summed) or per_pass.",
    )
    e.add_argument(
        "--expert-distribution-recorder-dir",
        default=None,
        help='Directory POST /dump_expert_distribution_record {"to_file": true} writes JSON records into.',
    )

    g = p.add_argument_group("CUDA graphs")
    g.add_argument(
        "--cuda-graph-max-bs",
        type=_int_range("--cuda-graph-max-bs", 1),
        default=default("cuda_graph_max_bs"),
        help="Largest decode batch size captured as a CUDA graph.",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="Run decode eagerly (always the case on CPU).",
    )
    g.add_argument(
        "--enable-piecewise-cuda-graph",
        action="store_true",
        help="Run EXTEND (prefill) through CUDA graphs of the non-attention pieces, attention eager between them.",
    )
    g.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=_int_range("--piecewise-cuda-graph-max-tokens", 1),
        default=default("piecewise_cuda_graph_max_tokens"),
        help="Largest EXTEND token count run through piecewise graphs (larger steps run eagerly).",
    )

    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve PEFT LoRA adapters next to the base model (disables the prefix cache and CUDA graphs).",
    )
    lo.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="Adapters loaded at start-up (a directory with adapter_config.json and adapter_model.safetensors); implies --enable-lora.",
    )
    lo.add_argument(
        "--max-loras-per-batch",
        type=_int_range("--max-loras-per-batch", 1),
        default=default("max_loras_per_batch"),
        help="Slots of the LoRA memory pool: adapters loaded at once.",
    )
    lo.add_argument(
        "--max-lora-rank",
        type=_int_range("--max-lora-rank", 1),
        default=None,
        help="Largest adapter rank r the pool holds (default: the largest of --lora-paths, else 16).",
    )
    lo.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=[],
        help="HF modules LoRA may touch: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all (default).",
    )

    o = p.add_argument_group("operation")
    o.add_argument(
        "--random-seed",
        type=_int_range("--random-seed", 0),
        default=default("random_seed"),
        help="Seed of the sampler for requests without their own seed.",
    )
    o.add_argument(
        "--log-level", default=default("log_level"), choices=LOG_LEVELS, help="Log level."
    )
    o.add_argument(
        "--watchdog-timeout",
        type=_int_range("--watchdog-timeout", 1),
        default=default("watchdog_timeout"),
        help="Seconds a forward step (or a peer rank) may stall before the process exits with an error.",
    )
    o.add_argument(
        "--drain-timeout",
        type=_int_range("--drain-timeout", 0),
        default=default("drain_timeout"),
        help="On SIGTERM: seconds to let running requests finish before aborting them.",
    )
    o.add_argument(
        "--weight-update-hold-timeout",
        type=_int_range("--weight-update-hold-timeout", 0),
        default=default("weight_update_hold_timeout"),
        help="Seconds a request arriving during a weight update waits for it to finish (then 503 with Retry-After); 0 refuses at once.",
    )
    w = p.add_argument_group("weight sync and memory release")
    w.add_argument(
        "--weight-version",
        default=default("weight_version"),
        help="Initial weight_version label (every weight update call may set a new one); reported in /get_server_info, /metrics and responses.",
    )
    w.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="/release_memory_occupation keeps a CPU copy of the weights, so /resume_memory_occupation restores them without a weight update.",
    )
    w.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="GPU: allocate weights and KV cache through torch-memory-saver (pip install torch-memory-saver), so release/resume keeps tensor addresses and captured graphs valid.",
    )
    return p
