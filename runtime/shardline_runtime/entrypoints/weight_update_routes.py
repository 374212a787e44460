"""``POST /update_weights_from_disk`` (DESIGN 2.4) and ``POST /abort_weight_update``.

An update stages the new weights (validated, loaded on the CPU) before it commits them into the
live parameters; ``/abort_weight_update`` stops a disk update that is queued or still staging,
so the old weights keep serving (an operator cancels a rollout the user reverted this way). The
update's reply then says ``"aborted": true`` (HTTP 409); an abort that comes after the commit
changes nothing, and its own reply says so (409, ``"committed": true``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from shardline_runtime.entrypoints.protocol import UpdateWeightsRequest
from shardline_runtime.entrypoints.weight_sync_routes import update_running
from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.model_loader.errors import ModelSourceError


async def local_model_path(text: str, server_args: Any, served_dir: str) -> str:
    """The local directory of an update's ``model_path``: itself, or for an hf:// / s3://
    reference the revision fetched into ``--download-dir`` (in a worker thread, so serving goes
    on), keeping ``served_dir`` (the local directory of the revision being served) when the
    cache is cut to ``--download-max-bytes``.

    Raises:
        ModelSourceError: malformed, missing, refused or corrupt (the reason names which).
    """
    from shardline_runtime.model_loader.model_source import fetch_to_local, parse_model_source

    if not parse_model_source(text, "model_path").is_remote:
        return text
    # The cache key is the local directory's name (the reported model_path is the uri).
    served = Path(served_dir).name if served_dir else ""
    fetched = await asyncio.to_thread(
        fetch_to_local,
        text,
        server_args.download_dir,
        max_bytes=server_args.download_max_bytes,
        keep=(served,) if served else (),
    )
    return str(fetched.path)


def _served(tm: TokenizerManager) -> dict[str, Any]:
    weights = tm.state.weights
    return {
        "revision": weights.revision,
        "model_path": weights.model_path,
        "weight_version": weights.weight_version,
        "weights_digest": weights.digest,
    }


def add_weight_update_routes(
    app: FastAPI, tm: TokenizerManager, error_response, server_args: Any
) -> None:
    """Register both routes on ``app`` (``error_response(status, message)`` builds the 503 for an
    update asked while one runs; ``server_args`` gives the download directory and its bound for
    an ``hf://`` / ``s3://`` ``model_path``)."""

    # The local directory serving now (``serve`` replaced a remote --model-path by it).
    served_dir = [str(getattr(server_args, "model_path", "") or "")]

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest):
        busy = update_running(tm, error_response)
        if busy is not None:
            return busy
        spec = getattr(server_args, "speculative", None)
        if body.draft_model_path is not None and (
            spec is None or spec.speculative_algorithm != "STANDALONE"
        ):
            message = (
                "draft_model_path is only accepted by a server with --speculative-algorithm "
                "STANDALONE (it updates the draft model); nothing was loaded"
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        try:  # fetched and verified while the group still serves the old weights
            model_path = await local_model_path(body.model_path, server_args, served_dir[0])
        except ModelSourceError as exc:
            message = f"{exc.reason}: {exc}"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        req = UpdateWeightsFromDiskReqInput(
            model_path,
            body.load_format,
            body.revision,
            body.recapture_cuda_graph,
            body.abort_all_requests,
            body.cuda_graph_max_bs,
            body.disable_cuda_graph,
            body.weight_version,
            body.flush_cache,
            model_source=body.model_path if model_path != body.model_path else None,
            # a local directory, as --speculative-draft-model-path (drafts are not fetched)
            draft_model_path=body.draft_model_path,
        )
        out = await tm.update_weights_from_disk(req)
        if out.success:
            served_dir[0] = model_path
        status = 200 if out.success else 409 if out.aborted else 400
        return JSONResponse(
            {
                "success": out.success,
                "message": out.message,
                "aborted": out.aborted,
                **_served(tm),
                "load_seconds": out.load_seconds,
                "recapture_seconds": out.recapture_seconds,
            },
            status_code=status,
        )

    @app.post("/abort_weight_update")
    async def abort_weight_update():
        out = await tm.abort_weight_update()
        if out is None:
            message = "no update_weights_from_disk is in progress"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        if out.aborted:
            return {"success": True, "message": out.message, **_served(tm)}
        outcome = "committed" if out.success else "failed"
        return JSONResponse(
            {
                "success": False,
                "committed": out.success,
                "message": f"too late: the update had {outcome} ({out.message})",
                **_served(tm),
            },
            status_code=409,
        )
