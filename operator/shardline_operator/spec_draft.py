"""Parse ``spec.runtime.speculative.draftModel``: the draft model (STANDALONE) or EAGLE head
(EAGLE) as ``path`` (an absolute directory on ``spec.model``'s volume) or ``uri``
(``hf://ORG/NAME[@REVISION]`` or ``s3://BUCKET/PREFIX``, the forms of ``spec.model.uri``).

A ``uri`` is handed to the runtime as ``--speculative-draft-model-path``; the runtime fetches
and verifies it at start into the same model cache as an hf:// or s3:// ``spec.model.uri``,
with the same credentials (``spec.model.credentialsSecretRef``, ``spec.model.s3``), so a draft
``uri`` needs a target ``uri`` of those forms. A change of the draft rolls in place with the
target (``runtime_args.ServedModel.draft``), and a draft ``uri`` is staged on the nodes by the
target's staging Jobs (``staging_step.staging_target``).
"""

from __future__ import annotations

from typing import Any

from .spec_fields import field_value
from .spec_model import HF_URI, S3_URI
from .spec_types import DRAFT_MODEL_ALGORITHMS, ModelSpec, SpecError, SpeculativeSpec

DRAFT_URI_FORMS = "hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"


def parse_draft_model(raw: dict[str, Any], path: str, algorithm: str) -> str | None:
    """``draftModel``'s ``path`` or ``uri`` (exactly one): required by a draft-model algorithm,
    refused otherwise. Raises :class:`SpecError` naming the field."""
    draft = field_value(raw, "draftModel", path, dict)
    if algorithm not in DRAFT_MODEL_ALGORITHMS:
        if draft is not None:
            raise SpecError(
                f"{path}.draftModel is not used by algorithm {algorithm}; "
                f"it needs one of {', '.join(DRAFT_MODEL_ALGORITHMS)}"
            )
        return None
    if draft is None:
        raise SpecError(f"{path}.draftModel is required with algorithm {algorithm}")
    dpath = f"{path}.draftModel"
    draft_path = field_value(draft, "path", dpath, str)
    uri = field_value(draft, "uri", dpath, str)
    if (draft_path is None) == (uri is None):
        raise SpecError(f"{dpath}: set exactly one of {dpath}.path and {dpath}.uri")
    if uri is not None:
        if not (HF_URI.match(uri) or S3_URI.match(uri)):
            raise SpecError(f"{dpath}.uri must be {DRAFT_URI_FORMS}, got {uri!r}")
        return uri
    assert draft_path is not None
    if not draft_path.startswith("/"):
        raise SpecError(f"{dpath}.path must be an absolute path, got {draft_path!r}")
    return draft_path


def check_draft_source(speculative: SpeculativeSpec | None, model: ModelSpec) -> None:
    """A draft ``uri`` is fetched with ``spec.model``'s cache and credentials: refuse it unless
    ``spec.model.uri`` is hf:// or s3://. Raises :class:`SpecError`."""
    draft = None if speculative is None else speculative.draft_model_path
    if draft is not None and not draft.startswith("/") and not model.is_remote:
        raise SpecError(
            "spec.runtime.speculative.draftModel.uri needs an hf:// or s3:// spec.model.uri (the "
            "draft is fetched into its model cache with its credentials); use draftModel.path"
        )
