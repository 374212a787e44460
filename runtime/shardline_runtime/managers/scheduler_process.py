"""Entry point of one scheduler process (one rank: a TP rank of a pipeline stage), spawned by
``launch.py`` with its world rank (``pp_rank * tp_size + tp_rank``).

It builds the rank's ``TpModelWorker`` (which joins the TP group and loads the weights),
reports ``{"status": "ready", "info": SchedulerInfo}`` (or ``{"status": "error", ...}``) on the
pipe to its launcher, then runs the scheduler loop until the launcher goes away. SIGINT and
SIGTERM are ignored here: the launcher drains the HTTP side first and then stops the ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import Any


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def rank_label(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``[tp 1]``, or ``[tp 1 pp 0]`` with pipeline parallelism (log and error prefixes)."""
    return f"[tp {tp_rank} pp {pp_rank}]" if pp_size > 1 else f"[tp {tp_rank}]"


def run_scheduler_process(
    server_args: Any, world_rank: int, input_addr: str | None, output_addr: str | None, pipe
) -> None:
    """Run one rank's scheduler; never returns normally (exits the process)."""
    from shardline_runtime.distributed.parallel_state import rank_layout

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pp_size = getattr(server_args, "pp_size", 1)
    pp_rank, tp_rank = rank_layout(world_rank, server_args.tp_size)
    label = rank_label(tp_rank, pp_rank, pp_size)
    configure_logging(server_args.log_level, label)
    parent = os.getppid()
    try:
        import torch

        if (
            server_args.device == "cpu" or not torch.cuda.is_available()
        ) and "OMP_NUM_THREADS" not in os.environ:
            # share the cores between this node's ranks (OMP_NUM_THREADS, when set, wins)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size_per_node))
        from shardline_runtime.managers.scheduler import Scheduler
        from shardline_runtime.managers.tp_worker import TpModelWorker

        worker = TpModelWorker(server_args, tp_rank, pp_rank=pp_rank)
        first = world_rank == 0
        scheduler = Scheduler(
            server_args,
            tp_rank,
            worker,
            input_addr if first else None,
            output_addr if first else None,
        )
        pipe.send({"status": "ready", "info": scheduler.scheduler_info()})
        with torch.inference_mode():
            scheduler.event_loop(should_stop=lambda: os.getppid() != parent)
        os._exit(0)
    except BaseException as exc:  # report every failure, including SystemExit from a bug
        message = f"{label} {type(exc).__name__}: {exc}"
        logging.getLogger(__name__).error("scheduler failed:\n%s", traceback.format_exc())
        from shardline_runtime.termination_log import write_termination_log

        write_termination_log(message)
        try:
            pipe.send({"status": "error", "message": message})
        except (OSError, ValueError):
            pass
        os._exit(1)
