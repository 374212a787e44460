"""Find the example manifests by what they contain, not by file name."""
from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def inference_deployments() -> list[tuple[Path, dict]]:
    """Every InferenceDeployment document in ``examples/*.yaml`` with its file."""
    found = []
    for path in sorted(EXAMPLES.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceDeployment":
                found.append((path, doc))
    return found


def tp2_example() -> tuple[Path, dict]:
    """The example serving TP=2 over two pods (one GPU per pod) from a single-document file.

    Raises LookupError listing the examples when none fits.
    """
    seen = []
    for path, doc in inference_deployments():
        par = doc.get("spec", {}).get("parallelism", {})
        seen.append(f"{path.name}: {par}")
        if par.get("tensor") == 2 and par.get("gpusPerPod", 1) == 1 and par.get("expert", 1) == 1 and \
                par.get("pipeline", 1) == 1 and "path" in doc["spec"].get("model", {}) and \
                len([d for d in yaml.safe_load_all(path.read_text()) if d]) == 1:
            return path, doc
    raise LookupError("no single-document example in examples/ has parallelism "
                      f"{{tensor: 2, gpusPerPod: 1}}; found: {seen or 'none'}")


def moe_ep2_example() -> tuple[Path, dict]:
    """The example serving a mixture-of-experts model with ``parallelism.expert: 2``.

    Raises LookupError listing the examples when none fits.
    """
    seen = []
    for path, doc in inference_deployments():
        par = doc.get("spec", {}).get("parallelism", {})
        seen.append(f"{path.name}: {par}")
        if par.get("expert") == 2:
            return path, doc
    raise LookupError(f"no example in examples/ has parallelism.expert 2; found: {seen or 'none'}")


def pipeline_example() -> tuple[Path, dict]:
    """The example serving with ``parallelism.pipeline: 2`` (tensor 2) over its pods.

    Raises LookupError listing the examples when none fits.
    """
    seen = []
    for path, doc in inference_deployments():
        par = doc.get("spec", {}).get("parallelism", {})
        seen.append(f"{path.name}: {par}")
        if par.get("pipeline") == 2 and par.get("tensor") == 2:
            return path, doc
    raise LookupError(f"no example in examples/ has parallelism {{tensor: 2, pipeline: 2}}; found: {seen or 'none'}")
