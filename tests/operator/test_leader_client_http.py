"""runtime_client.HttpLeaderClient against a local HTTP server playing a group leader."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardline_operator.runtime_client import HttpLeaderClient

PHASE_WAIT_SECONDS = 10.0


class Leader(BaseHTTPRequestHandler):
    """Plays a group leader. An update walks through ``loading`` and ``recapturing``, and moves
    on from a phase only once a ``/get_server_info`` answer has reported it (or after
    ``PHASE_WAIT_SECONDS``), so the test does not depend on how fast the client's sampler runs."""

    phase = "serving"
    reply = (200, {"success": True, "message": "ok"})
    bodies: list = []
    served: list = []  # every weights_phase reported to a client, in order
    gets: list = []  # every GET path, in order
    reported = threading.Condition()

    def do_GET(self):  # noqa: N802 (http.server API)
        Leader.gets.append(self.path)
        with Leader.reported:
            phase = Leader.phase
            Leader.served.append(phase)
            Leader.reported.notify_all()
        self._send(200, {"weights_phase": phase, "weights_revision": "rev-a", "model_path": "/m/rev-a"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Leader.bodies.append((self.path, body))
        if self.path == "/abort_weight_update":
            self._send(200, {"success": True, "message": "aborted"})
            return
        for phase in ("loading", "recapturing"):
            with Leader.reported:
                Leader.phase = phase
                Leader.reported.wait_for(lambda p=phase: Leader.served[-1:] == [p], PHASE_WAIT_SECONDS)
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
    Leader.bodies, Leader.served, Leader.gets, Leader.phase = [], [], [], "serving"
    Leader.reply = (200, {"success": True, "message": "ok", "load_seconds": 1.5, "recapture_seconds": 0.25})
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def wait_done(client, key, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, message = client.poll(key)
        if state != "pending":
            return state, message
        time.sleep(0.05)
    raise AssertionError(f"update not finished after {timeout} s")


def wait_for_get(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while path not in Leader.gets and time.monotonic() < deadline:
        time.sleep(0.05)


def test_success_and_sampled_phases(leader_url):
    client = HttpLeaderClient()
    assert client.poll("k") == ("unknown", "")
    client.start_update("k", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 60)
    assert client.poll("k")[0] == "pending"
    assert wait_done(client, "k") == ("success", "ok")
    assert Leader.bodies == [("/update_weights_from_disk", {"model_path": "/m/rev-b", "revision": "rev-b"})]
    phases = client.observed_phases("k")
    assert "loading" in Leader.served and "recapturing" in Leader.served, Leader.served
    assert [p for p in phases if p != "serving"] == ["loading", "recapturing"], (phases, Leader.served)
    assert client.observed_phases("k") == []  # each phase is handed out once
    assert client.update_seconds("k") == {"load_seconds": 1.5, "recapture_seconds": 0.25}
    # kept until the next update under "k" starts: a success held back until the group is Ready
    # again still carries its timings when it counts
    assert client.update_seconds("k") == {"load_seconds": 1.5, "recapture_seconds": 0.25}
    assert client.server_info(leader_url)["weights_revision"] == "rev-a"


def test_failure_message_from_the_runtime(leader_url):
    Leader.reply = (400, {"success": False, "message": "lm_head.weight: shape [64, 128] != [64, 64]"})
    client = HttpLeaderClient()
    client.start_update("k", leader_url, {"model_path": "/m/bad"}, 10)
    assert wait_done(client, "k") == ("failure", "lm_head.weight: shape [64, 128] != [64, 64]")
    assert client.update_seconds("k") == {}  # the reply carried none


def test_unreachable_leader_is_a_failure():
    client = HttpLeaderClient()
    client.start_update("k", "http://127.0.0.1:9", {"model_path": "/m"}, 2)
    state, message = wait_done(client, "k")
    assert state == "failure" and "request to http://127.0.0.1:9 failed" in message
    assert client.server_info("http://127.0.0.1:9") is None


def test_an_update_the_runtime_aborted_polls_as_aborted(leader_url):
    Leader.reply = (409, {"success": False, "aborted": True, "message": "aborted before it committed"})
    client = HttpLeaderClient()
    client.start_update("k", leader_url, {"model_path": "/m/rev-b"}, 30)
    assert wait_done(client, "k") == ("aborted", "aborted before it committed")


def test_a_failed_update_without_aborted_polls_as_failure(leader_url):
    Leader.reply = (400, {"success": False, "aborted": False, "message": "bad checkpoint"})
    client = HttpLeaderClient()
    client.start_update("k", leader_url, {"model_path": "/m/rev-b"}, 30)
    assert wait_done(client, "k") == ("failure", "bad checkpoint")


def test_abort_update_posts_to_abort_weight_update(leader_url):
    client = HttpLeaderClient()
    client.abort_update("k", leader_url)
    deadline = time.monotonic() + 30
    while not Leader.bodies and time.monotonic() < deadline:
        time.sleep(0.02)
    assert Leader.bodies == [("/abort_weight_update", {})]


def test_an_ended_update_calls_back_once_poll_hands_out_its_result(leader_url):
    polled_at_callback: list[tuple[str, str]] = []
    called = threading.Event()

    def ended(key):
        polled_at_callback.append(client.poll(key))
        called.set()

    client = HttpLeaderClient(on_update_end=ended)
    client.start_update("ns/x/g0", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 60)
    assert called.wait(30), "no callback after the update ended"
    assert polled_at_callback == [("success", "ok")]


def test_a_successful_update_starts_the_return_check_and_verify_takes_it(leader_url):
    """The return-to-routing ``/health_generate`` is sent as the update succeeds, not when a
    later pass asks: ``verify`` (no verify spec) takes that answer, once; the next asks again."""
    client = HttpLeaderClient()
    client.start_update("ns/x/g0", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 60)
    assert wait_done(client, "ns/x/g0") == ("success", "ok")
    wait_for_get("/health_generate")
    assert Leader.gets.count("/health_generate") == 1, Leader.gets
    passed, message = client.verify(leader_url)
    assert passed and "as the update ended" in message
    assert Leader.gets.count("/health_generate") == 1, "verify sent a second check"
    passed, message = client.verify(leader_url)
    assert passed and "as the update ended" not in message
    assert Leader.gets.count("/health_generate") == 2


def test_a_failed_update_starts_no_return_check(leader_url):
    Leader.reply = (400, {"success": False, "message": "bad checkpoint"})
    client = HttpLeaderClient()
    client.start_update("ns/x/g0", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 60)
    assert wait_done(client, "ns/x/g0")[0] == "failure"
    time.sleep(0.5)
    assert "/health_generate" not in Leader.gets


def test_a_new_update_forgets_the_previous_updates_return_check(leader_url):
    """A check taken after update B must not return the group after update C failed: C's start
    drops it, and the return asks the leader afresh."""
    client = HttpLeaderClient()
    client.start_update("ns/x/g0", leader_url, {"model_path": "/m/rev-b", "revision": "rev-b"}, 60)
    assert wait_done(client, "ns/x/g0") == ("success", "ok")
    wait_for_get("/health_generate")
    time.sleep(0.2)  # the check's answer is stored
    Leader.reply = (400, {"success": False, "message": "bad checkpoint"})
    client.start_update("ns/x/g0", leader_url, {"model_path": "/m/rev-c", "revision": "rev-c"}, 60)
    assert wait_done(client, "ns/x/g0")[0] == "failure"
    passed, message = client.verify(leader_url)
    assert passed and "as the update ended" not in message
    assert Leader.gets.count("/health_generate") == 2
