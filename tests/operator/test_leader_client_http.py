"""runtime_client.HttpLeaderClient against a local HTTP server playing a group leader."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardline_operator.runtime_client import HttpLeaderClient


class Leader(BaseHTTPRequestHandler):
    phase = "serving"
    reply = (200, {"success": True, "message": "ok"})
    seconds = 0.5
    bodies: list = []

    def do_GET(self):  # noqa: N802 (http.server API)
        self._send(200, {"weights_phase": Leader.phase, "weights_revision": "rev-a", "model_path": "/m/rev-a"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Leader.bodies.append((self.path, body))
        for phase in ("loading", "recapturing"):
            Leader.phase = phase
            time.sleep(Leader.seconds / 2)
        Leader.phase = "serving"
        self._send(*Leader.reply)

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def leader_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Leader)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Leader.bodies, Leader.reply = [], (200, {"success": True, "message": "ok"})
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def wait_done(client, key):
    for _ in range(100):
        state, message = client.poll(key)
        if state != "pending":
            return state, message
        time.sleep(0.05)
    raise AssertionError("update never finished")


def test_success_and_sampled_phases(leader_url):
    client = HttpLeaderClient()
    assert client.poll("k") == ("unknown", "")
    client.start_update("k", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 10)
    assert client.poll("k")[0] == "pending"
    assert wait_done(client, "k") == ("success", "ok")
    assert Leader.bodies == [("/update_weights_from_disk", {"model_path": "/m/rev-b", "revision": "rev-b"})]
    phases = client.observed_phases("k")
    assert [p for p in phases if p != "serving"] == ["loading", "recapturing"], phases
    assert client.observed_phases("k") == []  # each phase is handed out once
    assert client.server_info(leader_url)["weights_revision"] == "rev-a"


def test_failure_message_from_the_runtime(leader_url):
    Leader.reply = (400, {"success": False, "message": "lm_head.weight: shape [64, 128] != [64, 64]"})
    client = HttpLeaderClient()
    client.start_update("k", leader_url, {"model_path": "/m/bad"}, 10)
    assert wait_done(client, "k") == ("failure", "lm_head.weight: shape [64, 128] != [64, 64]")


def test_unreachable_leader_is_a_failure():
    client = HttpLeaderClient()
    client.start_update("k", "http://127.0.0.1:9", {"model_path": "/m"}, 2)
    state, message = wait_done(client, "k")
    assert state == "failure" and "request to http://127.0.0.1:9 failed" in message
    assert client.server_info("http://127.0.0.1:9") is None
