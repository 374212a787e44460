"""Process layout of one pod: scheduler processes per local rank, plus the HTTP server.

A model replica is ``tp_size * pp_size`` ranks (world rank ``pp_rank * tp_size + tp_rank``) over
``nnodes`` pods; node ``n`` runs the ``k = tp_size * pp_size / nnodes`` consecutive world ranks
``n * k .. n * k + k - 1``, one process per local GPU. So with ``k == tp_size`` each pod is one
pipeline stage, and the first stage (world rank 0, which talks to the HTTP server) is on node 0.

Node rank 0: spawns the schedulers of its ranks, starts uvicorn on ``--host:--port`` at once
(``/health`` and ``/ready`` answer 503 while the weights load), and swaps in the full API when
every local rank reported ready. Node rank > 0: spawns its schedulers and serves only
``/health`` and ``/ready``. Either way a dead scheduler process makes the pod unhealthy and the
launcher exits with status 1 (writing the first error line to the termination log); SIGTERM
drains and exits 0 (``drain.py``): ``/ready`` turns 503 at once, the listener stays open and new
requests are served while requests run or clients still arrive, then it closes (at most
``--drain-timeout`` seconds, then what still runs is aborted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from shardline_runtime.configs.pipeline_stage import PipelineLayoutError, layer_partition
from shardline_runtime.drain import DrainStep, RequestTracker, drain_step
from shardline_runtime.entrypoints.auth import guard
from shardline_runtime.lora.lora_config import parse_lora_paths
from shardline_runtime.managers.scheduler_process import (
    configure_logging,
    rank_label,
    run_scheduler_process,
)
from shardline_runtime.server_args import ServerArgs
from shardline_runtime.termination_log import write_termination_log

logger = logging.getLogger("shardline_runtime.launch")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _SwitchApp:
    """ASGI app that answers 503 (``/health``, ``/ready`` and everything else) until the real
    app is installed; then delegates to it."""

    def __init__(self, fallback: FastAPI):
        self.target: Any = fallback

    async def __call__(self, scope, receive, send):
        await self.target(scope, receive, send)


def _status_app(state: dict) -> FastAPI:
    """``/health`` and ``/ready`` from the launcher's state (node rank > 0, and while loading)."""
    app = FastAPI(title="Shardline runtime (status)")

    def status(ok: bool, what: str):
        if ok:
            return PlainTextResponse("OK")
        message = (
            state.get("fatal") or f"{what}: scheduler processes are starting (loading weights)"
        )
        return JSONResponse(
            {"error": {"message": message, "type": "service_unavailable", "code": 503}},
            status_code=503,
        )

    @app.get("/health")
    async def health():
        return status(state["healthy"] and state["ready"], "not healthy")

    @app.get("/ready")
    async def ready():
        return status(state["healthy"] and state["ready"] and not state["draining"], "not ready")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str):
        return status(False, "not ready")

    return app


class _Server(uvicorn.Server):
    """uvicorn server that drains on SIGTERM/SIGINT (``drain.py``: unready at once, serving and
    accepting while requests run or clients still arrive, aborted at ``--drain-timeout``). The
    launcher then exits 0 (uvicorn itself would re-raise the signal after shutdown, ending the
    process with -15). A second SIGINT exits at once."""

    def __init__(
        self, config: uvicorn.Config, state: dict, drain_timeout: float, tracker: RequestTracker
    ):
        super().__init__(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._tracker = tracker

    def handle_exit(self, sig, frame) -> None:
        loop, tm = self._state.get("loop"), self._state.get("tm")
        if self._state["draining"]:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self._state["draining"] = True
        if tm is None or loop is None:  # not serving requests yet (loading, or node rank > 0)
            self.should_exit = True
            return
        gate = tm.gate
        gate.draining = True
        loop.call_soon_threadsafe(gate.start_draining)  # paused requests get their 503 now
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    def _in_flight(self) -> int:
        return self._tracker.in_progress + self._state["tm"].in_flight

    async def _drain(self) -> None:
        """Run the drain's steps (:func:`drain_step`) every 50 ms; at ``--drain-timeout``, end
        what still runs with ``finish_reason: "abort"`` first (uvicorn waits a little longer,
        so those answers and streams complete before it closes)."""
        tm, started = self._state["tm"], time.monotonic()
        deadline = started + self._drain_timeout
        logger.info("SIGTERM: draining (%d requests in flight)", self._in_flight())
        if tm.disk_update is not None:  # the pod goes away: no point finishing new weights
            out = await tm.abort_weight_update()  # held requests then run on the weights serving
            logger.info("draining: %s", "update aborted" if out and out.aborted else "update ended")
        while True:
            quiet_since = max(started, self._tracker.last_arrival)
            step = drain_step(time.monotonic(), quiet_since, self._in_flight(), deadline)
            if step != DrainStep.ACCEPT:
                break
            await asyncio.sleep(0.05)
        if step == DrainStep.TIMEOUT:  # refuse new ones (503); done: uvicorn closes the listener
            tm.gate.closing = True  # and still serves a request it accepted in the meantime
        if step == DrainStep.TIMEOUT and self._in_flight():
            logger.warning("drain timeout: aborting %d running requests", len(tm.streams.states))
            tm.streams.abort_all_local("server shutting down (drain timeout)")
            await tm.abort(None)
        logger.info("drained in %.1f s", time.monotonic() - started)
        self.should_exit = True


def _spawn_schedulers(args: ServerArgs, input_addr: str, output_addr: str):
    from shardline_runtime.distributed.parallel_state import rank_layout, tp_ranks_of_node

    ctx = mp.get_context("spawn")
    procs = []
    for rank in tp_ranks_of_node(args.tp_size, args.nnodes, args.node_rank, args.pp_size):
        reader, writer = ctx.Pipe(duplex=False)
        pp_rank, tp_rank = rank_layout(rank, args.tp_size)
        name = f"shardline-scheduler-tp{tp_rank}" + (f"-pp{pp_rank}" if args.pp_size > 1 else "")
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(args, rank, input_addr, output_addr, writer),
            name=name,
        )
        proc.start()
        writer.close()
        procs.append((rank_label(tp_rank, pp_rank, args.pp_size), proc, reader))
    return procs


def _wait_ready(procs) -> tuple[list, str | None]:
    """Block until every scheduler reported (ready infos, or the first error message)."""
    infos: list = []
    for rank, proc, reader in procs:
        while not reader.poll(0.5):
            if not proc.is_alive():
                return (
                    infos,
                    f"{rank} scheduler process exited with code {proc.exitcode} while starting",
                )
        try:
            msg = reader.recv()
        except EOFError:
            return infos, f"{rank} scheduler process exited while starting"
        if msg["status"] != "ready":
            return infos, msg.get("message", f"{rank} failed")
        infos.append(msg["info"])
    return infos, None


async def _serve(args: ServerArgs, procs, ipc_dir: str, input_addr: str, output_addr: str) -> int:
    state: dict[str, Any] = {
        "healthy": True,
        "ready": False,
        "draining": False,
        "fatal": None,
        "tm": None,
        "started": time.time(),
    }
    switch = _SwitchApp(_status_app(state))
    # The key check wraps the whole server, so no route (present or future) is served around it.
    app = guard(switch, args.api_key, args.admin_api_key, args.port)
    tracker = RequestTracker(app)  # outermost: every request that reached the server counts
    config = uvicorn.Config(
        tracker,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout + 3,
        access_log=args.log_level == "debug",
    )
    server = _Server(config, state, args.drain_timeout, tracker)
    state["loop"] = asyncio.get_running_loop()
    serve_task = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    infos, error = await loop.run_in_executor(None, _wait_ready, procs)
    if error is None and args.node_rank == 0:
        try:
            switch.target = _full_app(args, infos[0], input_addr, output_addr, state)
        except Exception as exc:  # tokenizer missing, etc.
            error = f"HTTP server failed to start: {type(exc).__name__}: {exc}"
    exit_code = 0
    if error is None:
        state["ready"] = True
        logger.info(
            "ready: serving %s on http://%s:%d (tp_size %d, pp_size %d, node %d/%d)",
            args.model_name,
            args.host,
            args.port,
            args.tp_size,
            args.pp_size,
            args.node_rank,
            args.nnodes,
        )
        while not serve_task.done():
            dead = [(rank, p) for rank, p, _ in procs if not p.is_alive()]
            if dead and not state["draining"]:
                rank, p = dead[0]
                error = f"{rank} scheduler process died (exit code {p.exitcode})"
                break
            await asyncio.sleep(0.5)
    if error is not None:
        exit_code = 1
        logger.error("%s", error)
        write_termination_log(error)
        state["healthy"], state["fatal"] = False, error
        if state["tm"] is not None:
            state["tm"].streams.abort_all_local(error)
            await asyncio.sleep(0.5)  # let handlers answer their clients
        server.should_exit = True
    await serve_task
    return exit_code


def _full_app(args: ServerArgs, info, input_addr: str, output_addr: str, state: dict):
    from transformers import AutoTokenizer

    from shardline_runtime.entrypoints.http_server import build_app
    from shardline_runtime.entrypoints.metrics import ServingMetrics
    from shardline_runtime.managers.tokenizer_manager import TokenizerManager

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    tm = TokenizerManager(
        tokenizer,
        info,
        input_addr,
        output_addr,
        ServingMetrics(
            args.model_name,
            num_gpu_blocks=info.max_total_num_tokens,
            max_lora=args.max_loras_per_batch if args.enable_lora else None,
        ),
        hold_timeout=args.weight_update_hold_timeout,
        # loaded by every rank before it reported ready
        lora_adapters=parse_lora_paths(list(args.lora_paths)),
    )
    tm.start()
    state["tm"] = tm
    return build_app(tm, args, tm.metrics, state)


def _pipeline_layout_error(args: ServerArgs) -> str | None:
    """The layer split checked against ``config.json`` before ``tp x pp / nnodes`` processes are
    spawned (``--pp-size 64`` on a 2-layer model must not start 64 processes to learn it; each
    rank checks again with the full config). None when it fits or config.json is unreadable here
    (the ranks then report why)."""
    if args.pp_size == 1 and not args.pp_layer_partition:
        return None
    try:
        layers = int(
            json.loads((Path(args.model_path) / "config.json").read_text())["num_hidden_layers"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        layer_partition(layers, args.pp_size, args.pp_layer_partition)
    except PipelineLayoutError as exc:
        return f"PipelineLayoutError: {exc}"
    return None


def launch_server(args: ServerArgs) -> int:
    """Run the pod's processes until SIGTERM (returns 0) or a failure (returns 1)."""
    configure_logging(args.log_level, f"[node {args.node_rank}]")
    try:  # fail fast, before loading anything, when --host:--port cannot be bound
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((args.host, args.port))
    except OSError as exc:
        message = f"cannot listen on --host {args.host} --port {args.port}: {exc}"
        logger.error(message)
        write_termination_log(message)
        return 1
    layout_error = _pipeline_layout_error(args)
    if layout_error is not None:
        logger.error("%s", layout_error)
        write_termination_log(layout_error)
        return 1
    if args.world_size > 1 and args.nnodes == 1 and not args.dist_init_addr:
        args = args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
    ipc_dir = tempfile.mkdtemp(prefix="shardline-")
    input_addr, output_addr = f"ipc://{ipc_dir}/scheduler_input", f"ipc://{ipc_dir}/http_output"
    procs = _spawn_schedulers(args, input_addr, output_addr)
    try:
        return asyncio.run(_serve(args, procs, ipc_dir, input_addr, output_addr))
    except Exception as exc:
        write_termination_log(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for _, proc, _ in procs:
            if proc.is_alive():
                proc.kill()
        for _, proc, _ in procs:
            proc.join(timeout=10)
        shutil.rmtree(ipc_dir, ignore_errors=True)
