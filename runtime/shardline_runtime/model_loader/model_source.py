"""Where a model lives: a local directory, a Hugging Face repository or an S3 prefix.

``--model-path`` (and ``spec.model.uri`` through the operator's staging Job) accepts:

- a local directory (used as it is, never copied);
- ``hf://org/name[@revision]`` or a bare ``org/name`` that is not a local directory (as vLLM and
  SGLang take a Hub id), the revision being a commit, branch or tag, resolved to a commit;
- ``s3://bucket/prefix``: every object under ``prefix/``; the endpoint, region and keys come from
  the environment as boto3 reads them (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
  ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``).

A remote model is fetched into ``--download-dir`` as one directory per resolved revision
(``revision_cache.py``), verified before it is used, so the loader only ever reads a local,
complete checkpoint (DESIGN 2.5: the loader never downloads).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardline_runtime.model_loader.errors import ModelSourceError

# Hub repository ids: huggingface_hub's validate_repo_id rules (namespace/name, each of letters,
# digits, '-', '_', '.', at most 96 characters, no '--' or '..').
_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
# S3 bucket names (AWS rules: 3-63 of lower-case letters, digits, '.', '-').
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total) while a revision is fetched."""


@dataclass(frozen=True)
class ModelSource:
    """One parsed model reference.

    ``scheme`` ``local``: ``location`` is the directory. ``hf``: ``location`` is the repo id and
    ``revision`` the asked revision (``None``: the default branch). ``s3``: ``location`` is the
    bucket and ``prefix`` the key prefix without a trailing ``/``.
    """

    scheme: Literal["local", "hf", "s3"]
    location: str
    prefix: str = ""
    revision: str | None = None

    @property
    def is_remote(self) -> bool:
        """True for ``hf`` and ``s3`` sources (they must be fetched before loading)."""
        return self.scheme != "local"

    def __str__(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.location}" + (f"@{self.revision}" if self.revision else "")
        if self.scheme == "s3":
            return f"s3://{self.location}/{self.prefix}"
        return self.location


@dataclass(frozen=True)
class FetchedModel:
    """A model on local disk: ``path`` (a complete, verified directory), ``revision`` (the Hub
    commit, the S3 listing's digest ``etags-<sha256[:16]>``, or ``None`` for a local directory)."""

    path: Path
    revision: str | None
    source: ModelSource


def parse_model_source(text: str, field: str = "--model-path") -> ModelSource:
    """Parse a model reference (see the module docstring).

    A bare ``org/name`` names a Hub repository only when no such local directory exists.

    Raises:
        ModelSourceError: a malformed ``hf://`` or ``s3://`` reference (names ``field`` and the
            accepted forms).
    """
    if text.startswith("hf://"):
        body = text[len("hf://") :]
        repo_id, sep, revision = body.partition("@")
        if not REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
            raise ModelSourceError(
                f"{field}: {text!r} is not hf://ORG/NAME[@REVISION] (ORG and NAME: letters, "
                "digits, '-', '_', '.'; at most 96 characters each)"
            )
        if sep and not REVISION.fullmatch(revision):
            raise ModelSourceError(
                f"{field}: revision {revision!r} of {text!r} must be a commit, branch or tag "
                "(letters, digits, '.', '_', '-', '/')"
            )
        return ModelSource("hf", repo_id, revision=revision or None)
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://") :].partition("/")
        prefix = prefix.strip("/")
        if not BUCKET.fullmatch(bucket) or not prefix:
            raise ModelSourceError(
                f"{field}: {text!r} is not s3://BUCKET/PREFIX (BUCKET: 3-63 lower-case letters, "
                "digits, '.', '-'; PREFIX: the non-empty key prefix of the checkpoint's files)"
            )
        return ModelSource("s3", bucket, prefix=prefix)
    if "://" in text:
        raise ModelSourceError(
            f"{field}: unknown scheme in {text!r}; use a local directory, hf://ORG/NAME[@REVISION] "
            "or s3://BUCKET/PREFIX"
        )
    if not Path(text).exists() and REPO_ID.fullmatch(text):
        return ModelSource("hf", text)
    return ModelSource("local", text)


def fetch_model(
    source: ModelSource,
    download_dir: str | Path,
    *,
    revision: str | None = None,
    progress: Progress | None = None,
) -> FetchedModel:
    """Bring ``source`` onto local disk under ``download_dir`` and verify it.

    ``revision`` is used for an ``hf`` source that names none (vLLM's ``--revision``). A revision
    already complete in ``download_dir`` is reused without downloading; an interrupted one
    resumes. Network I/O: the Hub API or S3, through huggingface_hub or boto3.

    Raises:
        ModelSourceError: missing repository, revision, bucket or prefix; refused credentials
            (401/403); a checksum or size mismatch; a local directory that does not exist.
    """
    if source.scheme == "local":
        if not Path(source.location).is_dir():
            raise ModelSourceError(f"--model-path: {source.location!r} is not a directory")
        return FetchedModel(Path(source.location), None, source)
    root = Path(download_dir)
    if source.scheme == "hf":
        from shardline_runtime.model_loader.hf_source import fetch_hf

        asked = source.revision or revision
        path, commit = fetch_hf(source.location, asked, root, progress)
        return FetchedModel(path, commit, source)
    from shardline_runtime.model_loader.s3_source import fetch_s3

    path, digest = fetch_s3(source.location, source.prefix, root, progress)
    return FetchedModel(path, digest, source)


def fetch_to_local(
    text: str,
    download_dir: str | Path,
    *,
    revision: str | None = None,
    max_bytes: int = 0,
    keep: tuple[str, ...] = (),
) -> FetchedModel:
    """Parse ``text`` and fetch it (:func:`fetch_model`); then, with ``max_bytes`` > 0, cut the
    cache to that bound, least recently used revisions first, never the fetched one nor the
    cache keys in ``keep`` (the revision still served during an update).

    Raises:
        ModelSourceError: as :func:`parse_model_source` and :func:`fetch_model`.
    """
    fetched = fetch_model(parse_model_source(text), download_dir, revision=revision)
    if max_bytes and fetched.source.is_remote:
        from shardline_runtime.model_loader.revision_cache import evict

        evict(fetched.path.parent, max_bytes, keep={fetched.path.name, *keep})
    return fetched
