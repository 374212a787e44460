"""Keys, NetworkPolicies and pod security as the operator renders and reconciles them."""

from __future__ import annotations

import base64
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardline_operator import credentials, labels
from shardline_operator.reconcile import Context, reconcile
from shardline_operator.render import build_admin_secret, build_network_policy, build_statefulset
from shardline_operator.runtime_args import ServedModel
from shardline_operator.runtime_client import HttpLeaderClient
from shardline_operator.spec import SpecError, parse_spec

from fake_kube import FakeKube
from fake_leaders import FakeLeaders

AUTH = {"apiKeySecretRef": {"name": "llama-api-key", "key": "key"}}


def container_of(spec):
    return build_statefulset(spec, 0, ServedModel.desired(spec))["spec"]["template"]["spec"]["containers"][0]


def b64(text):
    return base64.b64encode(text.encode()).decode()


class TestRenderedPods:
    def test_keys_come_from_secrets_never_from_args(self, make_spec):
        container = container_of(make_spec({"auth": AUTH}))
        env = {e["name"]: e.get("valueFrom") for e in container["env"]}
        assert env["SHARDLINE_ADMIN_API_KEY"] == {"secretKeyRef": {"name": "llama-admin-token", "key": "token"}}
        assert env["SHARDLINE_API_KEY"] == {"secretKeyRef": {"name": "llama-api-key", "key": "key"}}
        assert not any("api-key" in arg for arg in container["args"])

    def test_without_auth_only_the_admin_key_is_set(self, make_spec):
        names = [e["name"] for e in container_of(make_spec())["env"]]
        assert "SHARDLINE_ADMIN_API_KEY" in names and "SHARDLINE_API_KEY" not in names

    def test_pod_meets_the_restricted_pod_security_standard(self, make_spec):
        spec = make_spec()
        pod = build_statefulset(spec, 0, ServedModel.desired(spec))["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the runtime image's user
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        context = pod["containers"][0]["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert "hostNetwork" not in pod and "hostPID" not in pod


class TestNetworkPolicy:
    def policy(self, make_spec, overrides=None, operator_namespace="shardline-system", group=1):
        return build_network_policy(make_spec(overrides or {}), group, operator_namespace)

    def test_selects_one_group_and_admits_only_ingress_rules(self, make_spec):
        policy = self.policy(make_spec)
        assert policy["metadata"]["name"] == "llama-g1"
        assert policy["spec"]["podSelector"] == {"matchLabels": {"shardline.dev/deployment": "llama",
                                                                 "shardline.dev/group": "1"}}
        assert policy["spec"]["policyTypes"] == ["Ingress"]

    def test_rendezvous_and_nccl_ports_only_from_the_same_group(self, make_spec):
        same_group, http = self.policy(make_spec)["spec"]["ingress"]
        assert same_group == {"from": [{"podSelector": {"matchLabels": {"shardline.dev/deployment": "llama",
                                                                        "shardline.dev/group": "1"}}}]}
        assert http["ports"] == [{"protocol": "TCP", "port": 8000}]

    def test_http_port_from_listed_namespaces_own_namespace_and_the_operator(self, make_spec):
        _, http = self.policy(make_spec, {"networkPolicy": {"allowedNamespaces": ["apps", "default"]}})["spec"]["ingress"]
        assert http["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shardline-system"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "shardline",
                                             "app.kubernetes.io/component": "operator"}}},
        ]

    def test_operator_outside_the_cluster_adds_no_rule(self, make_spec):
        _, http = self.policy(make_spec, operator_namespace=None)["spec"]["ingress"]
        assert len(http["from"]) == 1


class TestSpec:
    @pytest.mark.parametrize("auth,message", [
        ({"apiKeySecretRef": {"key": "k"}}, "spec.auth.apiKeySecretRef.name is required"),
        ({"apiKeySecretRef": {"name": "Bad_Name"}}, "spec.auth.apiKeySecretRef.name must be a Secret name"),
        ({"apiKeySecretRef": {"name": "s", "key": "a key"}}, "spec.auth.apiKeySecretRef.key must be"),
    ])
    def test_bad_auth_names_the_field(self, spec_dict, auth, message):
        with pytest.raises(SpecError, match=message):
            parse_spec("llama", "default", "u", {**spec_dict, "auth": auth})

    def test_bad_namespace_names_the_field(self, spec_dict):
        with pytest.raises(SpecError, match="spec.networkPolicy.allowedNamespaces items must be namespace names"):
            parse_spec("llama", "default", "u", {**spec_dict, "networkPolicy": {"allowedNamespaces": ["Apps"]}})

    @pytest.mark.parametrize("runtime,message", [
        ({"env": [{"name": "SHARDLINE_API_KEY", "value": "x"}]}, "must not set SHARDLINE_API_KEY"),
        ({"args": ["--admin-api-key=x"]}, "must not set --admin-api-key"),
    ])
    def test_keys_cannot_be_set_around_the_secrets(self, spec_dict, runtime, message):
        with pytest.raises(SpecError, match=message):
            parse_spec("llama", "default", "u", {**spec_dict, "runtime": {**spec_dict["runtime"], **runtime}})

    def test_key_values_and_references_change_the_restart_hash(self, make_spec):
        from dataclasses import replace
        spec = make_spec()
        assert replace(spec, credentials_digest="aaaa").restart_hash() != replace(spec, credentials_digest="bbbb").restart_hash()
        assert make_spec({"auth": AUTH}).restart_hash() != spec.restart_hash()
        assert make_spec({"networkPolicy": {"enabled": False}}).restart_hash() == spec.restart_hash()


class TestCredentials:
    def test_admin_tokens_are_random_and_long(self):
        tokens = {credentials.new_admin_token() for _ in range(20)}
        assert len(tokens) == 20 and all(len(t) >= 43 for t in tokens)

    def test_secret_value_strips_a_final_newline(self):
        assert credentials.secret_value({"data": {"k": b64("sk-1\n")}}, "k") == "sk-1"
        assert credentials.secret_value({"data": {"k": "%%%"}}, "k") is None
        assert credentials.secret_value({"data": {}}, "k") is None

    def test_missing_secret_or_key_names_the_field(self):
        with pytest.raises(SpecError, match="spec.auth.apiKeySecretRef: Secret 's' not found in namespace 'ns'"):
            credentials.api_key_from_secret(None, "s", "k", "ns")
        with pytest.raises(SpecError, match=r"has no key 'k' \(keys: \['other'\]\)"):
            credentials.api_key_from_secret({"data": {"other": b64("x")}}, "s", "k", "ns")
        with pytest.raises(SpecError, match="printable ASCII"):
            credentials.api_key_from_secret({"data": {"k": b64("two words")}}, "s", "k", "ns")

    def test_admin_secret_is_owned_and_immutable(self, make_spec):
        secret = build_admin_secret(make_spec(), "tok")
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
        assert secret["immutable"] is True and credentials.secret_value(secret, "token") == "tok"


class TokenLeaders(FakeLeaders):
    """Records the admin token and API key the reconciler hands to the leader client."""

    tokens: list = []
    api_keys: list = []

    def with_token(self, token, api_key=None):
        TokenLeaders.tokens.append(token)
        TokenLeaders.api_keys.append(api_key)
        return self


@pytest.fixture
def world(spec_dict):
    kube = FakeKube()
    now = [1_700_000_000.0]
    ctx = Context(kube=kube, leaders=TokenLeaders(), clock=lambda: now[0], operator_namespace="shardline-system")
    body = {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "default", "uid": "cr-uid", "generation": 1},
            "spec": spec_dict, "status": {}}

    def run(**changes):
        now[0] += 5
        for key, value in changes.items():
            body["spec"][key] = value
            body["metadata"]["generation"] += 1
        result = reconcile(ctx, copy.deepcopy(body))
        body["status"] = result.status
        return result

    TokenLeaders.tokens = []
    TokenLeaders.api_keys = []
    return kube, run


def user_secret(kube, value):
    kube.objects[("Secret", "default", "llama-api-key")] = {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llama-api-key", "namespace": "default"},
        "data": {"key": b64(value)}}


def restart_hashes(kube):
    return {name: sts["spec"]["template"]["metadata"]["annotations"][labels.ANNOTATION_RESTART_HASH]
            for (kind, _, name), sts in kube.objects.items() if kind == "StatefulSet"}


class TestReconcile:
    def test_admin_token_is_created_once_and_handed_to_the_leader_client(self, world):
        kube, run = world
        run()
        token = credentials.secret_value(kube.get("v1", "Secret", "default", "llama-admin-token"), "token")
        run()
        assert credentials.secret_value(kube.get("v1", "Secret", "default", "llama-admin-token"), "token") == token
        assert TokenLeaders.tokens == [token, token]

    def test_the_api_key_from_the_secret_goes_to_the_leader_client_for_the_canary_gate(self, world):
        kube, run = world
        run()
        user_secret(kube, "sk-1")
        run(auth=AUTH)
        assert TokenLeaders.api_keys == [None, "sk-1"]

    def test_missing_api_key_secret_fails_with_the_field_then_recovers(self, world):
        kube, run = world
        result = run(auth=AUTH)
        assert result.status["phase"] == "Failed"
        assert "spec.auth.apiKeySecretRef: Secret 'llama-api-key' not found" in result.status["message"]
        user_secret(kube, "sk-1")
        assert run().status["phase"] == "Pending"

    def test_rotating_the_api_key_restarts_groups_one_at_a_time(self, world):
        kube, run = world
        user_secret(kube, "sk-1")
        run(auth=AUTH)
        kube.run_statefulsets()
        assert run().status["phase"] == "Ready"
        before = restart_hashes(kube)
        user_secret(kube, "sk-2")
        result = run()
        assert any(e[1] == "GroupRestart" and "group 0" in e[2] for e in result.events)
        assert set(kube.pods()) == {"llama-g1-0", "llama-g1-1"}  # group 0 restarts first, group 1 waits
        after = restart_hashes(kube)
        assert after["llama-g0"] != before["llama-g0"] and after["llama-g1"] == before["llama-g1"]

    def test_network_policies_follow_replicas_and_the_switch(self, world):
        kube, run = world
        run()
        policies = lambda: sorted(n for (k, _, n) in kube.objects if k == "NetworkPolicy")  # noqa: E731
        assert policies() == ["llama-g0", "llama-g1"]
        run(replicas=1)
        assert policies() == ["llama-g0"]
        run(networkPolicy={"enabled": False})
        assert policies() == []


class Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):  # noqa: N802 (http.server API)
        self._reply()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply()

    def _reply(self):
        Recorder.seen.append((self.command, self.path, self.headers.get("Authorization")))
        data = json.dumps({"success": True, "weights_phase": "serving"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_leader_client_sends_the_admin_token_on_every_call():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    Recorder.seen = []
    try:
        client = HttpLeaderClient().with_token("adm-1", "sk-1")
        client.start_update("k", url, {"model_path": "/m"}, 10)
        for _ in range(100):
            if client.poll("k")[0] != "pending":
                break
            threading.Event().wait(0.05)
        client.server_info(url)
        for _ in range(100):  # the return check begun as the update succeeded
            if any(path == "/health_generate" for _, path, _ in Recorder.seen):
                break
            threading.Event().wait(0.05)
    finally:
        server.shutdown()
    assert ("POST", "/update_weights_from_disk", "Bearer adm-1") in Recorder.seen
    # /health_generate is a serving endpoint: it carries the API key, every other call the token
    assert ("GET", "/health_generate", "Bearer sk-1") in Recorder.seen, Recorder.seen
    others = [auth for _, path, auth in Recorder.seen if path != "/health_generate"]
    assert all(auth == "Bearer adm-1" for auth in others), Recorder.seen
