"""The ``CUDA graphs and torch.compile`` flag group of ``shardline-runtime serve`` and the rules
for when ``--enable-torch-compile`` composes with the other flags.

``--enable-torch-compile`` and ``--torch-compile-max-bs`` are SGLang's flags: Inductor compiles
the decode forward (attention stays outside the compiled graph, ``layers/radix_attention.py``)
for the decode batch sizes up to ``--torch-compile-max-bs``, inside the captured decode CUDA
graphs on a GPU and on the same padded static-buffer path on the CPU
(``model_executor/torch_compile.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from shardline_runtime.server_args_sections import default


def add_graph_flags(
    p: argparse.ArgumentParser, int_range: Callable[..., Callable[[str], int]]
) -> None:
    """The ``CUDA graphs`` flag group; ``int_range(flag, low)`` makes a range check."""
    g = p.add_argument_group("CUDA graphs and torch.compile")
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int_range("--cuda-graph-max-bs", 1),
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
        type=int_range("--piecewise-cuda-graph-max-tokens", 1),
        default=default("piecewise_cuda_graph_max_tokens"),
        help="Largest EXTEND token count run through piecewise graphs (larger steps run eagerly).",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="Compile the decode forward with torch.compile (Inductor; attention stays outside) for "
        "decode batches up to --torch-compile-max-bs, captured inside the decode CUDA graphs on a "
        "GPU (the CPU needs a C++ compiler). Compiles at start-up on a GPU, at a size's first step on the CPU.",
    )
    g.add_argument(
        "--torch-compile-max-bs",
        type=int_range("--torch-compile-max-bs", 1),
        default=default("torch_compile_max_bs"),
        help="Largest decode batch size run through the compiled forward (larger ones run uncompiled).",
    )


def torch_compile_errors(args: Any) -> list[str]:
    """Why ``--enable-torch-compile`` does not compose with the other ``ServerArgs`` (empty: it
    does, or it is off). Each message names the flags and what to change."""
    if not args.graphs.enable_torch_compile:
        return []
    errors = []
    if args.graphs.disable_cuda_graph:
        errors.append(
            "--enable-torch-compile runs inside the decode graph path; drop --disable-cuda-graph"
        )
    if args.lora.enable_lora:
        errors.append(
            "--enable-torch-compile is not supported with --enable-lora / --lora-paths "
            "(adapter batches are not compiled); drop one of them"
        )
    if args.parallel.pp_size > 1:
        errors.append("--enable-torch-compile is not supported with --pp-size > 1; use --pp-size 1")
    if args.speculative.speculative_algorithm is not None:
        errors.append(
            "--enable-torch-compile is not supported with --speculative-algorithm; drop one of them"
        )
    if args.experts.eplb_rebalance_num_iterations > 0:
        errors.append(
            "--enable-torch-compile is not supported with --eplb-rebalance-num-iterations > 0 "
            "(the expert recorder is not compiled); set it to 0"
        )
    return errors
