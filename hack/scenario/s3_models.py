"""A deployment whose model lives in a real S3 server (versitygw), shared by
``tests/e2e/test_model_from_s3.py`` and ``bench/rollout.py --staging``: upload checkpoint
revisions, the keys Secret, and ``examples/model-from-s3.yaml`` as two groups of TP=1."""
from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model-from-s3.yaml"
BUCKET = "models"
SECRET = "s3-keys"


def s3_client(s3):
    """A boto3 client of the running ``hack.s3server.S3Server`` ``s3``."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3.env["AWS_REGION"],
    ).client("s3", endpoint_url=s3.endpoint)


def upload_revisions(s3, revisions: dict[str, Path], prefixes: dict[str, str]) -> None:
    """Create :data:`BUCKET` and upload ``revisions[source]`` under ``tiny/<prefix>`` for each
    ``prefix -> source`` of ``prefixes``."""
    client = s3_client(s3)
    client.create_bucket(Bucket=BUCKET)
    for prefix, source in prefixes.items():
        for path in sorted(revisions[source].iterdir()):
            if path.is_file():
                client.put_object(Bucket=BUCKET, Key=f"tiny/{prefix}/{path.name}", Body=path.read_bytes())


def s3_deployment(cluster, s3, namespace: str, name: str, prefix: str, cache_volume: dict | None) -> dict:
    """Create ``namespace`` and the keys Secret; return the example as two groups of TP=1 serving
    ``s3://models/tiny/<prefix>`` (revision label ``prefix``) with ``cache_volume`` (None: the
    default per-pod emptyDir)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(replicas=2, parallelism={"tensor": 1, "gpusPerPod": 1})
    model = doc["spec"]["model"]
    model.update(uri=f"s3://{BUCKET}/tiny/{prefix}", revision=prefix, name="tiny-llama")
    model["s3"] = {"endpoint": s3.endpoint, "region": s3.env["AWS_REGION"]}
    model.pop("cache")
    if cache_volume is not None:
        model["cache"] = {"volume": cache_volume}
    doc["spec"]["runtime"].update(dtype="float32", maxTotalTokens=4096)
    keys = {k: s3.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    cluster.kubectl("create", "namespace", namespace, check=False)
    cluster.kubectl("create", "secret", "generic", SECRET, "-n", namespace,
                    *[f"--from-literal={k}={v}" for k, v in keys.items()])
    return doc
