"""spec.loraAdapters: parsing, the rendered runtime flags, the load/unload plan, and in-place
sync through reconcile (no pod restart) with status.loraAdapters."""

from __future__ import annotations

import copy

import pytest

from shardline_operator import labels
from shardline_operator.lora_sync import decide_lora, plan
from shardline_operator.observed import GroupObservation, LeaderObservation, PodObservation
from shardline_operator.pass_plan import LoadAdapter, Observation
from shardline_operator.reconcile import Context, reconcile
from shardline_operator.runtime_args import ServedModel, runtime_args
from shardline_operator.spec import LoRAAdapterSpec, SpecError

from fake_kube import FakeKube
from fake_leaders import FakeLeaders

ROOT = "/var/lib/shardline/models/adapters"
NOW = [1_800_000_000.0]


class FakeLoRALeaders(FakeLeaders):
    """A leader per URL holding ``{name: path}``; paths in ``bad`` fail to load (400)."""

    def __init__(self):
        super().__init__()
        self.loaded: dict[str, dict[str, str]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.bad: set[str] = set()

    def lora_adapters(self, url):
        return dict(self.loaded.setdefault(url, {}))

    def load_lora_adapter(self, url, name, path):
        self.calls.append(("load", url, name))
        if path in self.bad:
            return False, f"lora_path {path!r}: adapter_config.json not found"
        self.loaded.setdefault(url, {})[name] = path
        return True, "loaded"

    def unload_lora_adapter(self, url, name):
        self.calls.append(("unload", url, name))
        self.loaded.setdefault(url, {}).pop(name)
        return True, "unloaded"


def adapters(*names):
    return [{"name": n, "path": f"{ROOT}/{n}"} for n in names]


def test_spec_parses_and_renders_flags_the_runtime_accepts(make_spec):
    from shardline_runtime.server_args import make_parser

    spec = make_spec({"loraAdapters": adapters("a", "b")})
    assert spec.lora_adapters == (LoRAAdapterSpec("a", f"{ROOT}/a"), LoRAAdapterSpec("b", f"{ROOT}/b"))
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    parsed = make_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1").replace("$(POD_INDEX)", "0") for a in args])
    assert parsed.enable_lora and parsed.lora_paths == [f"a={ROOT}/a", f"b={ROOT}/b"]
    # enabling LoRA restarts pods; changing the list does not
    assert make_spec().restart_hash() != spec.restart_hash() == make_spec({"loraAdapters": adapters("c")}).restart_hash()
    assert "--enable-lora" not in runtime_args(make_spec(), 0, ServedModel.desired(make_spec()))


@pytest.mark.parametrize("raw, message", [
    (adapters("a", "a"), "spec.loraAdapters[1].name 'a' is repeated"),
    ([{"name": "a", "path": "rel/dir"}], "spec.loraAdapters[0].path must be an absolute"),
    ([{"name": "-x", "path": "/p"}], "spec.loraAdapters[0].name must be"),
    ([{"path": "/p"}], "spec.loraAdapters[0].name is required"),
    (adapters(*[f"a{i}" for i in range(9)]), "holds 8 at once"),
])
def test_invalid_adapters_name_the_field(make_spec, raw, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_spec({"loraAdapters": raw})


def test_more_adapters_with_a_larger_pool(make_spec):
    spec = make_spec({"loraAdapters": adapters(*[f"a{i}" for i in range(9)]),
                      "runtime": {"image": "x", "args": ["--max-loras-per-batch", "16"]}})
    assert len(spec.lora_adapters) == 9


def test_plan_unloads_removed_and_moved_then_loads_missing():
    desired = (LoRAAdapterSpec("a", "/a2"), LoRAAdapterSpec("b", "/b"))
    steps = plan(desired, {"a": "/a", "c": "/c", "b": "/b"})
    assert steps.unload == ("a", "c") and [x.name for x in steps.load] == ["a"]
    assert plan(desired, {"a": "/a2", "b": "/b"}).unload == () == plan(desired, {"a": "/a2", "b": "/b"}).load


def test_reconcile_adds_and_removes_adapters_in_place(spec_dict):
    kube, leaders = FakeKube(), FakeLoRALeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    body = {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "default", "uid": "cr-uid", "generation": 1},
            "spec": {**spec_dict, "loraAdapters": adapters("a")}, "status": {}}

    def run(**changes):
        NOW[0] += 5
        for key, value in changes.items():
            body["spec"][key] = value
            body["metadata"]["generation"] += 1
        result = reconcile(ctx, copy.deepcopy(body))
        body["status"] = result.status
        return result

    run()
    kube.run_statefulsets()
    for (kind, _, name), obj in kube.objects.items():  # one leader IP per group
        if kind == "Pod":
            obj["status"]["podIP"] = f"127.0.{name.split('-g')[1].split('-')[0]}.{int(name.rsplit('-', 1)[1]) + 1}"
    sts = kube.objects[("StatefulSet", "default", "llama-g0")]
    assert f"a={ROOT}/a" in sts["spec"]["template"]["spec"]["containers"][0]["args"]  # passed at group start
    result = run()
    assert result.status["loraAdapters"] == [{"name": "a", "path": f"{ROOT}/a", "loadedGroups": 2}]
    uids = {n: p["metadata"]["uid"] for n, p in kube.pods().items()}

    result = run(loraAdapters=adapters("a", "b"))
    assert [e["loadedGroups"] for e in result.status["loraAdapters"]] == [2, 2]
    result = run(loraAdapters=adapters("b"))
    assert result.status["loraAdapters"] == [{"name": "b", "path": f"{ROOT}/b", "loadedGroups": 2}]
    assert all(m == {"b": f"{ROOT}/b"} for m in leaders.loaded.values()) and len(leaders.loaded) == 2
    assert [c[0] for c in leaders.calls].count("unload") == 2

    leaders.bad.add(f"{ROOT}/missing")
    result = run(loraAdapters=adapters("b", "missing"))
    missing = result.status["loraAdapters"][1]
    assert missing["loadedGroups"] == 0 and "adapter_config.json not found" in missing["error"]
    assert result.requeue_after_seconds is not None
    assert any(e[1] == "LoRAAdapterFailed" for e in result.events)
    result = run(loraAdapters=adapters("b"))
    assert "error" not in result.status["loraAdapters"][0] and result.requeue_after_seconds is None
    assert {n: p["metadata"]["uid"] for n, p in kube.pods().items()} == uids  # no pod restarted
    assert result.status["phase"] == "Ready"
    assert all(p["metadata"]["annotations"][labels.ANNOTATION_RESTART_HASH] for p in kube.pods().values())


def _ready_group(index: int) -> GroupObservation:
    pod = PodObservation(name=f"llama-g{index}-0", uid=f"u{index}", rank=0, ip=f"10.0.0.{index + 1}", phase="Running",
                         ready=True, deleting=False, restart_count=0, terminated=False, error_message=None,
                         restart_hash=None)
    return GroupObservation(index=index, size=1, statefulset={}, pods=(pod,), answers=LeaderObservation(adapters={}))


def test_adapters_are_not_synced_to_a_group_updating_weights():
    """docs/operations.md: leaders get load/unload calls each pass, not a group updating weights
    (the pass leaves out the groups of the rollout's wave)."""
    desired = (LoRAAdapterSpec(name="a", path=f"{ROOT}/a"),)
    groups = [_ready_group(0), _ready_group(1)]
    observed = Observation(generation=1, groups={g.index: g for g in groups}, lora_client=True)
    actions, decision = decide_lora(desired, groups, observed, busy={0})
    assert actions == [LoadAdapter(1, "http://10.0.0.2:8000", "a", f"{ROOT}/a")]  # group 1 only
    assert decision.pending  # group 0 is synced on a later pass, once its update has ended
