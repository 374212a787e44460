"""Fetch a Hugging Face Hub repository at one commit, through ``huggingface_hub``.

As vLLM's and SGLang's ``download_weights_from_hf``: the revision is resolved to a commit
(``HfApi.repo_info``), the files a model needs are downloaded with ``snapshot_download`` (which
resumes interrupted files), then every file is checked against the Hub's tree listing with
``HfApi.verify_repo_checksums`` (sha256 of LFS files, git blob sha1 of the others) before the
revision is renamed into the cache. The token comes from the environment (``HF_TOKEN``), the
endpoint from ``HF_ENDPOINT``, as the client reads them.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from shardline_runtime.model_loader.errors import ModelSourceError, SourceErrors
from shardline_runtime.model_loader.model_source import Progress
from shardline_runtime.model_loader.revision_cache import revision_key, stage_revision

# What a model directory needs: config and tokenizer files, safetensors weights, templates.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")


def fetch_hf(
    repo_id: str, revision: str | None, root: Path, progress: Progress | None = None
) -> tuple[Path, str]:
    """Download ``repo_id`` at ``revision`` (``None``: the default branch) into the cache under
    ``root``; return (the revision's directory, its commit sha).

    Raises:
        ModelSourceError: reason ``NotFound`` (repository or revision), ``Unauthorized``
            (401/403, gated), ``ChecksumMismatch``, ``FetchFailed`` (other Hub errors).
    """
    from huggingface_hub import HfApi

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read per call, not at import
    api = HfApi(endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None)
    where = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    with _hub_errors(where):
        info = api.model_info(repo_id, revision=revision)
    commit = str(info.sha)
    files = {
        s.rfilename: s.size or 0
        for s in info.siblings or []
        if any(fnmatch.fnmatch(s.rfilename, p) for p in ALLOW_PATTERNS)
    }
    if not any(name.endswith(".safetensors") for name in files):
        raise ModelSourceError(
            f"{where} (commit {commit}) has no *.safetensors file; Shardline loads safetensors only",
            "NotAModel",
        )

    def fill(partial: Path) -> None:
        from huggingface_hub import snapshot_download

        if progress is not None:
            progress(0, sum(files.values()))
        with _hub_errors(where):
            snapshot_download(
                repo_id,
                revision=commit,
                local_dir=partial,
                allow_patterns=list(ALLOW_PATTERNS),
                endpoint=endpoint,
                token=api.token,
            )
            check = api.verify_repo_checksums(repo_id, revision=commit, local_dir=partial)
        if check.mismatches:
            bad = check.mismatches[0]
            for mismatch in check.mismatches:  # the next try downloads them again
                (partial / mismatch["path"]).unlink(missing_ok=True)
            raise ModelSourceError(
                f"{where}: {bad['path']} does not match the Hub's {bad['algorithm']} "
                f"(expected {bad['expected']}, got {bad['actual']}); "
                f"{len(check.mismatches)} file(s) differ",
                "ChecksumMismatch",
            )
        missing = [p for p in check.missing_paths if p in files]
        if missing:
            raise ModelSourceError(f"{where}: not downloaded: {missing}", "FetchFailed")
        shutil.rmtree(partial / ".cache", ignore_errors=True)  # the client's resume metadata
        if progress is not None:
            progress(sum(files.values()), sum(files.values()))

    verified = {"uri": f"hf://{repo_id}", "resolvedRevision": commit}
    return stage_revision(root, revision_key("hf", repo_id, commit), fill, verified), commit


class _hub_errors(SourceErrors):
    """Turn huggingface_hub's errors into ``ModelSourceError`` with a reason code."""

    def translate(self, exc: BaseException) -> None:
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, RevisionNotFoundError):
            raise ModelSourceError(f"{self.where}: revision not found", "NotFound") from exc
        if isinstance(exc, GatedRepoError):
            raise ModelSourceError(
                f"{self.where}: gated repository; its token has no access", "Unauthorized"
            ) from exc
        if isinstance(exc, RepositoryNotFoundError):
            raise ModelSourceError(
                f"{self.where}: repository not found (or private and the token has no access)",
                "NotFound",
            ) from exc
        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else None
            reason = "Unauthorized" if status in (401, 403) else "FetchFailed"
            raise ModelSourceError(f"{self.where}: {first_line}", reason) from exc
        if isinstance(exc, OSError | ValueError):
            raise ModelSourceError(f"{self.where}: {first_line}", "FetchFailed") from exc
