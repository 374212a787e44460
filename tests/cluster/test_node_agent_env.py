"""Node agent env building, without a cluster: kubelet's $(VAR) expansion and downward API."""
from __future__ import annotations

import base64

import pytest

from hack.node_agent.env import (
    EnvError,
    container_argv,
    container_env,
    empty_dir_paths,
    expand,
    field_ref,
    host_path_paths,
    remap_paths,
)

POD = {
    "metadata": {"name": "demo-g0-1", "namespace": "ns1", "uid": "u-1",
                 "labels": {"apps.kubernetes.io/pod-index": "1", "app": "x"}},
    "spec": {"nodeName": "gpu-node-0", "serviceAccountName": "sa"},
    "status": {"podIP": "127.77.1.5", "podIPs": [{"ip": "127.77.1.5"}], "hostIP": "127.0.0.1"},
}


@pytest.mark.parametrize("text,expected", [
    ("--host $(POD_IP)", "--host 127.77.1.5"),
    ("$(POD_IP):$(PORT)", "127.77.1.5:8000"),
    ("$(MISSING)", "$(MISSING)"),
    ("$$(POD_IP)", "$(POD_IP)"),
    ("$$", "$"),
    ("a$b", "a$b"),
    ("cost $", "cost $"),
    ("$(unclosed", "$(unclosed"),
    ("$()", "$()"),
    ("$$$(PORT)", "$8000"),
])
def test_expand_matches_kubelet(text, expected):
    assert expand(text, {"POD_IP": "127.77.1.5", "PORT": "8000"}) == expected


def test_field_refs():
    assert field_ref(POD, "status.podIP") == "127.77.1.5"
    assert field_ref(POD, "metadata.labels['apps.kubernetes.io/pod-index']") == "1"
    assert field_ref(POD, "metadata.annotations['none']") == ""
    assert field_ref(POD, "spec.nodeName") == "gpu-node-0"
    with pytest.raises(EnvError, match="unsupported fieldRef"):
        field_ref(POD, "status.phase")


def test_container_env_order_and_sources():
    secrets = {("Secret", "ns1", "s"): {"token": base64.b64encode(b"hush").decode()},
               ("ConfigMap", "ns1", "cm"): {"A": "1", "B": "2"}}
    container = {
        "name": "runtime",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
            {"name": "ADDR", "value": "$(POD_IP):$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k",
                                                              "optional": True}}},
        ],
        "command": ["shardline-runtime", "serve"],
        "args": ["--host", "$(POD_IP)", "--node-rank", "$(POD_INDEX)", "--x=$$(POD_IP)"],
    }
    env = container_env(POD, container, lambda k, ns, n: secrets.get((k, ns, n)))
    assert env["CM_A"] == "1" and env["CM_B"] == "2"
    # Only variables defined earlier are expanded inside env values, as in kubelet.
    assert env["ADDR"] == "127.77.1.5:$(LATER)"
    assert env["TOKEN"] == "hush"
    assert "OPT" not in env
    assert container_argv(container, env) == [
        "shardline-runtime", "serve", "--host", "127.77.1.5", "--node-rank", "1",
        "--x=$(POD_IP)"]


def test_missing_required_key_and_command_are_clear_errors():
    c = {"name": "c", "env": [{"name": "X", "valueFrom": {
        "configMapKeyRef": {"name": "cm", "key": "k"}}}]}
    with pytest.raises(EnvError, match="ConfigMap ns1/cm key 'k' not found"):
        container_env(POD, c, lambda *a: None)
    with pytest.raises(EnvError, match="has no command"):
        container_argv({"name": "c"}, {})


def test_empty_dir_env_moves_to_the_pods_directory(tmp_path):
    pod = {"spec": {"volumes": [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    container = {"volumeMounts": [{"name": "home", "mountPath": "/home/shardline"},
                                  {"name": "tmp", "mountPath": "/tmp"},
                                  {"name": "dshm", "mountPath": "/dev/shm"}]}
    paths = empty_dir_paths(pod, container, tmp_path)
    env = remap_paths({"HOME": "/home/shardline", "TMPDIR": "/tmp", "X": "/home/shardline/.cache/t",
                       "Y": "/home/shardlinex"}, paths)
    assert env == {"HOME": f"{tmp_path}/home", "TMPDIR": str(tmp_path), "X": f"{tmp_path}/home/.cache/t",
                   "Y": "/home/shardlinex"}


def test_dev_shm_is_not_remapped(tmp_path):
    pod = {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    container = {"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    assert empty_dir_paths(pod, container, tmp_path) == {}


def test_host_path_env_moves_to_the_host_directory(tmp_path):
    pod = {"spec": {"volumes": [{"name": "model-cache", "hostPath": {"path": str(tmp_path)}}]}}
    container = {"volumeMounts": [{"name": "model-cache", "mountPath": "/var/lib/shardline/model-cache"}]}
    env = remap_paths({"SHARDLINE_MODEL_CACHE": "/var/lib/shardline/model-cache"}, host_path_paths(pod, container))
    assert env == {"SHARDLINE_MODEL_CACHE": str(tmp_path)}
