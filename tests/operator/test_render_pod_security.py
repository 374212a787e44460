"""render/: the runtime pod runs read-only as uid 10001, with every writable path an emptyDir."""

from __future__ import annotations

from shardline_operator import labels
from shardline_operator.render import render_children
from shardline_operator.render.volumes import CACHE_DIR, HOME_DIR, TMP_DIR


def pod_spec(make_spec, overrides=None):
    children = render_children(make_spec(overrides or {}))
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    return sts["spec"]["template"]["spec"]


def runtime_container(make_spec, overrides=None):
    return pod_spec(make_spec, overrides)["containers"][0]


def mounts_by_path(container):
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def volumes_by_name(spec):
    return {v["name"]: v for v in spec["volumes"]}


def env_values(container):
    return {e["name"]: e.get("value") for e in container["env"]}


def test_root_file_system_is_read_only(make_spec):
    assert runtime_container(make_spec)["securityContext"]["readOnlyRootFilesystem"] is True


def test_container_runs_as_the_image_user(make_spec):
    assert runtime_container(make_spec)["securityContext"]["runAsUser"] == labels.RUNTIME_UID


def test_every_capability_is_dropped(make_spec):
    assert runtime_container(make_spec)["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_home_cache_and_tmp_are_empty_dirs(make_spec):
    spec = pod_spec(make_spec)
    mounts = mounts_by_path(spec["containers"][0])
    volumes = volumes_by_name(spec)
    for path in (HOME_DIR, CACHE_DIR, TMP_DIR):
        assert volumes[mounts[path]] == {"name": mounts[path], "emptyDir": {}}, path


def test_library_caches_write_under_the_cache_volume(make_spec):
    env = env_values(runtime_container(make_spec))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "TORCH_HOME"):
        assert env[name].startswith(CACHE_DIR + "/"), name


def test_home_and_tmpdir_point_at_their_volumes(make_spec):
    env = env_values(runtime_container(make_spec))
    assert (env["HOME"], env["TMPDIR"]) == (HOME_DIR, TMP_DIR)


def test_user_env_comes_after_the_writable_paths(make_spec):
    container = runtime_container(make_spec, {"runtime": {"image": "r:1", "env": [{"name": "HF_HOME", "value": "/m"}]}})
    names = [e["name"] for e in container["env"]]
    assert names.index("HF_HOME", names.index("HF_HOME") + 1) > names.index("HOME")


def test_dev_shm_is_memory_backed(make_spec):
    spec = pod_spec(make_spec)
    volume = volumes_by_name(spec)[mounts_by_path(spec["containers"][0])["/dev/shm"]]
    assert volume["emptyDir"]["medium"] == "Memory"


def test_dev_shm_is_sized_per_gpu_for_nccl(make_spec):
    spec = pod_spec(make_spec, {"parallelism": {"tensor": 8, "gpusPerPod": 4}})
    volume = volumes_by_name(spec)[mounts_by_path(spec["containers"][0])["/dev/shm"]]
    assert volume["emptyDir"]["sizeLimit"] == "4Gi"


def test_model_volume_stays_read_only(make_spec):
    container = runtime_container(make_spec)  # the base spec mounts a hostPath model
    model = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert model["readOnly"] is True
