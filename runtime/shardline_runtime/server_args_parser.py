"""The one command-line parser of ``shardline-runtime serve`` (:func:`make_parser`).

Flag names follow ``sglang.launch_server`` where the concept is the same. Per-flag ranges are
checked by the argparse ``type`` functions (``--port 0``: ``argument --port: must be in [1,
65535], got 0``); defaults come from the sections (``server_args_sections.py``), choices too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from shardline_runtime.configs.pooling_config import add_model_kind_argument
from shardline_runtime.entrypoints.chat_output import add_chat_parser_flags
from shardline_runtime.layers.quantization.online_fp8 import ONLINE_CHOICES
from shardline_runtime.server_args_graphs import add_graph_flags
from shardline_runtime.server_args_sections import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOG_LEVELS,
    RECORDER_MODES,
    default,
)
from shardline_runtime.speculative.spec_args import add_speculative_flags

API_KEY_ENV = "SHARDLINE_API_KEY"
ADMIN_API_KEY_ENV = "SHARDLINE_ADMIN_API_KEY"


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


def make_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """Return the argument parser of ``shardline-runtime serve`` (flags only, no subcommand)."""
    p = argparse.ArgumentParser(
        prog="shardline-runtime serve",
        description="Serve a model with Shardline's tensor-parallel runtime (OpenAI-compatible HTTP API).",
        add_help=add_help,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # "--pp-s 1" in spec.runtime.args must not override the rendered --pp-size
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        required=True,
        help="Directory with config.json, *.safetensors and the tokenizer; or a Hub repository "
        "(hf://ORG/NAME[@REVISION], or ORG/NAME when no such directory exists) or s3://BUCKET/PREFIX, "
        "fetched into --download-dir and verified before loading.",
    )
    m.add_argument(
        "--download-dir",
        default=default("download_dir"),
        help="Cache of fetched hf:// and s3:// models, one directory per resolved revision.",
    )
    m.add_argument(
        "--download-max-bytes",
        type=_int_range("--download-max-bytes", 0),
        default=default("download_max_bytes"),
        help="LRU bound of --download-dir in bytes (0: none); the served revision is never evicted.",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients pass as the OpenAI 'model' field (default: --model-path).",
    )
    m.add_argument(
        "--revision",
        default=None,
        help="Label of the checkpoint revision, reported by /get_server_info and /metrics; for a "
        "Hub repository without @REVISION, also the Hub revision fetched (as vLLM's --revision).",
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
        "--quantization",
        default=default("quantization"),
        choices=ONLINE_CHOICES,
        help="auto: serve the checkpoint's quantization_config (unquantized without one); fp8: quantize a bf16 checkpoint to FP8 per channel at load and at every weight update.",
    )
    add_model_kind_argument(m, default("model_kind"))
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
    add_chat_parser_flags(h, default("tool_call_parser"))
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
        help="Process each step's result before preparing the next step (default: the next step is prepared and launched while the current one computes; off with --enable-lora, with --speculative-algorithm, and with --pp-size > 1, whose micro-batches keep the stages busy instead).",
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

    add_graph_flags(p, _int_range)

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
    add_speculative_flags(p, _int_range)
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
