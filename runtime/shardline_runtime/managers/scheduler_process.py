"""Entry point of one scheduler process (one TP rank), spawned by ``launch.py``.

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


def run_scheduler_process(server_args: Any, tp_rank: int, input_addr: str | None, output_addr: str | None, pipe) -> None:
    """Run one TP rank's scheduler; never returns normally (exits the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(server_args.log_level, f"[tp {tp_rank}]")
    parent = os.getppid()
    try:
        import torch

        if (server_args.device == "cpu" or not torch.cuda.is_available()) and "OMP_NUM_THREADS" not in os.environ:
            # share the cores between this node's ranks (OMP_NUM_THREADS, when set, wins)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size_per_node))
        from shardline_runtime.managers.scheduler import Scheduler
        from shardline_runtime.managers.tp_worker import TpModelWorker

        worker = TpModelWorker(server_args, tp_rank)
        first = tp_rank == 0
        scheduler = Scheduler(server_args, tp_rank, worker, input_addr if first else None, output_addr if first else None)
        pipe.send({"status": "ready", "info": scheduler.scheduler_info()})
        with torch.inference_mode():
            scheduler.event_loop(should_stop=lambda: os.getppid() != parent)
        os._exit(0)
    except BaseException as exc:  # report every failure, including SystemExit from a bug
        message = f"[tp {tp_rank}] {type(exc).__name__}: {exc}"
        logging.getLogger(__name__).error("scheduler failed:\n%s", traceback.format_exc())
        from shardline_runtime.termination_log import write_termination_log

        write_termination_log(message)
        try:
            pipe.send({"status": "error", "message": message})
        except (OSError, ValueError):
            pass
        os._exit(1)
