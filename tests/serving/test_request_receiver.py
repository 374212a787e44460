"""RequestReceiver over real ZMQ sockets: rank 0 looks ahead for one kind of message while a
long control runs (an abort during a weight update), and keeps everything else, in order, for
the next iteration."""

from __future__ import annotations

import time

import pytest
import zmq

from shardline_runtime.managers.io_struct import AbortReq, AbortWeightUpdateReqInput, FlushCacheReqInput
from shardline_runtime.managers.request_receiver import RequestReceiver


@pytest.fixture
def sockets(tmp_path):
    ctx = zmq.Context.instance()
    addr = f"ipc://{tmp_path}/in"
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    yield pull, push
    push.close(0)
    pull.close(0)


def _send(push, pull, *messages):
    for msg in messages:
        push.send_pyobj(msg)
    deadline = time.monotonic() + 5
    while not pull.poll(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # all of them delivered


def test_take_finds_the_waiting_message_of_its_type(sockets):
    pull, push = sockets
    receiver = RequestReceiver(pull, tp_size=1)
    _send(push, pull, FlushCacheReqInput(), AbortWeightUpdateReqInput(), AbortReq("r1"))
    assert receiver.take(AbortWeightUpdateReqInput)


def test_take_keeps_the_other_messages_in_order_for_the_next_recv(sockets):
    pull, push = sockets
    receiver = RequestReceiver(pull, tp_size=1)
    _send(push, pull, FlushCacheReqInput(), AbortWeightUpdateReqInput(), AbortReq("r1"))
    receiver.take(AbortWeightUpdateReqInput)
    assert [type(m).__name__ for m in receiver.recv()] == ["FlushCacheReqInput", "AbortReq"]


def test_take_without_such_a_message_says_no(sockets):
    pull, push = sockets
    receiver = RequestReceiver(pull, tp_size=1)
    _send(push, pull, AbortReq("r1"))
    assert not receiver.take(AbortWeightUpdateReqInput)


def test_a_rank_without_the_socket_never_takes(sockets):
    assert not RequestReceiver(None, tp_size=1).take(AbortWeightUpdateReqInput)
