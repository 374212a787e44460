"""``shardline-runtime download``'s live progress and rate cap: where the pod finds its API
access (``pod_progress.api_access``), and the cap against a real S3 server (versitygw).

The annotation itself is written to a real API server by ``tests/e2e/test_model_from_s3.py``.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
import yaml

from shardline_runtime import termination_log
from shardline_runtime.cli import main
from shardline_runtime.pod_progress import PodAnnotator, api_access


def _kubeconfig(tmp_path, token="t0k"):
    doc = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443",
                                               "certificate-authority-data": base64.b64encode(b"PEM").decode()}}],
        "users": [{"name": "u", "user": {"token": token} if token else {}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_in_cluster_access_uses_the_mounted_token(tmp_path):
    (tmp_path / "token").write_text("abc\n")
    access = api_access({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert access.token == "abc"


def test_in_cluster_access_names_the_service_address(tmp_path):
    (tmp_path / "token").write_text("abc")
    access = api_access({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert access.server == "https://[fd00::1]:443"


def test_kubeconfig_access_reads_the_current_contexts_token(tmp_path):
    access = api_access({"KUBECONFIG": _kubeconfig(tmp_path)}, tmp_path / "none")
    assert access.token == "t0k"


def test_kubeconfig_access_decodes_the_ca(tmp_path):
    access = api_access({"KUBECONFIG": _kubeconfig(tmp_path)}, tmp_path / "none")
    assert access.ca_data == "PEM"


def test_kubeconfig_without_a_token_gives_no_access(tmp_path):
    assert api_access({"KUBECONFIG": _kubeconfig(tmp_path, token=None)}, tmp_path / "none") is None


def test_outside_a_pod_there_is_no_annotator(tmp_path):
    assert PodAnnotator.from_environment({"KUBECONFIG": _kubeconfig(tmp_path)}) is None


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv("SHARDLINE_TERMINATION_LOG", str(path))
    monkeypatch.setattr(termination_log, "_written", False)
    return lambda: json.loads(path.read_text())


def test_a_bad_rate_cap_fails_permanently_naming_the_variable(tmp_path, monkeypatch, record):
    monkeypatch.setenv("SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND", "fast")
    main(["download", "--model-path", "s3://b/p", "--download-dir", str(tmp_path)])
    assert "SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND" in record()["message"]


def test_a_bad_rate_cap_exits_3(tmp_path, monkeypatch, record):
    monkeypatch.setenv("SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND", "0")
    assert main(["download", "--model-path", "s3://b/p", "--download-dir", str(tmp_path)]) == 3


def test_a_zero_rate_cap_flag_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["download", "--model-path", "s3://b/p", "--download-dir", str(tmp_path),
              "--max-bytes-per-second", "0"])


@pytest.mark.slow
def test_rate_cap_bounds_the_average_download_rate(s3, tmp_path, record):
    _, bucket = s3
    started = time.monotonic()
    main(["download", "--model-path", f"s3://{bucket}/tiny/v1", "--download-dir", str(tmp_path / "c"),
          "--max-bytes-per-second", str(1 << 20)])
    assert time.monotonic() - started >= record()["bytes"] / (1 << 20) * 0.9
