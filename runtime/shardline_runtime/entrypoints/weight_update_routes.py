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
from shardline_runtime.speculative.spec_args import DRAFT_MODEL_ALGORITHMS


async def local_model_path(
    text: str, server_args: Any, keep: tuple[str, ...] = (), field: str = "model_path"
) -> str:
    """The local directory of an update's ``model_path`` (or ``draft_model_path``, named by
    ``field``): itself, or for an hf:// / s3:// reference the revision fetched into
    ``--download-dir`` (in a worker thread, so serving goes on), keeping the local directories
    in ``keep`` (the revisions being served, the target just fetched) when the cache is cut to
    ``--download-max-bytes``.

    Raises:
        ModelSourceError: malformed, missing, refused or corrupt (the reason names which).
    """
    from shardline_runtime.model_loader.model_source import fetch_to_local, parse_model_source

    if not parse_model_source(text, field).is_remote:
        return text
    # The cache key is the local directory's name (the reported model_path is the uri).
    fetched = await asyncio.to_thread(
        fetch_to_local,
        text,
        server_args.download_dir,
        max_bytes=server_args.download_max_bytes,
        keep=tuple(Path(d).name for d in keep if d),
    )
    return str(fetched.path)


async def local_paths(
    body: UpdateWeightsRequest, server_args: Any, served: list[str]
) -> tuple[str, str | None]:
    """The local directories of the update's target and draft, both fetched and verified
    before either is loaded (``served``: the directories serving now, kept in the cache).

    Raises:
        ModelSourceError: either fetch failed; the message names ``draft_model_path`` for the
            draft's.
    """
    model_path = await local_model_path(body.model_path, server_args, tuple(served))
    if body.draft_model_path is None:
        return model_path, None
    try:
        draft = await local_model_path(
            body.draft_model_path, server_args, (*served, model_path), "draft_model_path"
        )
    except ModelSourceError as exc:
        raise ModelSourceError(
            f"draft_model_path {body.draft_model_path}: {exc}", exc.reason
        ) from exc
    return model_path, draft


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

    # The local directories serving now, target then draft (``serve`` replaced a remote
    # --model-path and --speculative-draft-model-path by them).
    spec = getattr(server_args, "speculative", None)
    draft_dir = getattr(spec, "speculative_draft_model_path", None) or ""
    served_dirs = [str(getattr(server_args, "model_path", "") or ""), str(draft_dir)]

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest):
        busy = update_running(tm, error_response)
        if busy is not None:
            return busy
        if body.draft_model_path is not None and (
            spec is None or spec.speculative_algorithm not in DRAFT_MODEL_ALGORITHMS
        ):
            message = (
                "draft_model_path is only accepted by a server with --speculative-algorithm "
                "STANDALONE or EAGLE (it updates the draft model or EAGLE head); nothing was loaded"
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        try:  # both fetched and verified while the group still serves the old weights
            model_path, draft_path = await local_paths(body, server_args, served_dirs)
        except ModelSourceError as exc:  # all or nothing: neither is loaded
            message = f"{exc.reason}: {exc}; nothing was loaded, the old target and draft serve"
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
            draft_model_path=draft_path,
            draft_model_source=(
                body.draft_model_path if draft_path != body.draft_model_path else None
            ),
            admit_seconds=body.admit_seconds,
        )
        out = await tm.update_weights_from_disk(req, keep_ready=body.keep_ready)
        if out.success:
            served_dirs[0] = model_path
            served_dirs[1] = draft_path or served_dirs[1]
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
