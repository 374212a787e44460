"""The staging Job's command line parses with the runtime's own ``download`` parser, and the
exit code its ``podFailurePolicy`` fails on is the one ``download`` uses for permanent failures."""

from __future__ import annotations

from shardline_operator.render.staging_job import EXIT_PERMANENT, build_staging_job
from shardline_operator.spec import parse_spec
from shardline_operator.staging_step import staging_target
from shardline_runtime import download_cli
from tests.contract.test_runtime_args_contract import expand

SPEC = {
    "replicas": 2,
    "model": {"name": "tiny", "uri": "hf://Org/Name@v2", "credentialsSecretRef": {"name": "hf-token"},
              "cache": {"volume": {"hostPath": {"path": "/var/lib/shardline/model-cache"}}}},
    "parallelism": {"tensor": 1, "gpusPerPod": 1},
    "runtime": {"image": "shardline-runtime:test"},
}


def _job_args():
    spec = parse_spec("llama", "serving", "uid", SPEC)
    container = build_staging_job(spec, staging_target(spec), "node-0", 1)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return container, [expand(a, env) for a in container["args"]]


def test_staging_job_args_parse_with_the_download_parser():
    _, args = _job_args()
    assert download_cli.make_parser().parse_args(args).model_path == "hf://Org/Name@v2"


def test_staging_job_downloads_into_the_mounted_cache():
    container, args = _job_args()
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert download_cli.make_parser().parse_args(args).download_dir in mounts


def test_permanent_failure_exit_code_matches_the_runtime():
    assert EXIT_PERMANENT == download_cli.EXIT_PERMANENT


def test_a_remote_draft_reaches_the_download_parser():
    raw = {**SPEC, "runtime": {"image": "shardline-runtime:test", "speculative": {
        "algorithm": "STANDALONE", "draftModel": {"uri": "hf://Org/Draft@v1"}}}}
    spec = parse_spec("llama", "serving", "uid", raw)
    container = build_staging_job(spec, staging_target(spec), "node-0", 1)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    args = [expand(a, env) for a in container["args"]]
    assert download_cli.make_parser().parse_args(args).draft_model_path == "hf://Org/Draft@v1"
