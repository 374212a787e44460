"""How one rank gets each loop iteration's messages.

Rank 0 of stage 0 reads every message waiting on its ZMQ PULL socket and broadcasts the list to
the other TP ranks (``broadcast_pyobj``), so every rank processes the same messages. A later
pipeline stage receives the list from the stage before it (``PipelineLoop`` forwards it).

While a long control runs (a weight update staging its weights), rank 0 can look ahead for one
kind of message (:meth:`RequestReceiver.take`): what it reads meanwhile is kept, in order, for
the next :meth:`RequestReceiver.recv`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from shardline_runtime.distributed import broadcast_pyobj, recv_pyobj

IDLE_POLL_MS = 500  # rank 0 heartbeat while idle: keeps other ranks' broadcast within its timeout


def open_sockets(input_addr: str | None, output_addr: str | None) -> tuple[Any, Any]:
    """Rank 0's sockets: a PULL socket bound at ``input_addr`` (requests) and a PUSH socket
    connected to ``output_addr`` (outputs); ``(None, None)`` without both addresses (tests)."""
    if input_addr is None or output_addr is None:
        return None, None
    ctx: zmq.Context = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_addr)
    return pull, push


class RequestReceiver:
    """This rank's source of messages.

    Args:
        socket: rank 0's PULL socket, or None on every other rank.
        tp_size: ranks of this stage (the list is broadcast to them).
        pp_rank: this rank's pipeline stage (a later stage receives from the stage before).
    """

    def __init__(self, socket: Any, tp_size: int, pp_rank: int = 0):
        self.socket = socket
        self.tp_size = tp_size
        self.pp_rank = pp_rank
        self.poller = zmq.Poller()
        self.backlog: list[Any] = []  # read ahead by :meth:`take`, not yet handed out
        # rank 0 of stage 0: messages made on this rank for every rank (``GrammarsReady``),
        # added after the socket's, before the broadcast
        self.local_source: Callable[[], list[Any]] | None = None
        if socket is not None:
            self.poller.register(socket, zmq.POLLIN)

    def recv(self, idle: bool = False) -> list[Any]:
        """This iteration's messages; rank 0 blocks up to :data:`IDLE_POLL_MS` when ``idle``
        (not when messages were read ahead)."""
        if self.pp_rank > 0:
            return recv_pyobj(self.pp_rank - 1)
        messages, self.backlog = self.backlog, []
        if self.socket is not None and self.poller.poll(
            0 if messages or not idle else IDLE_POLL_MS
        ):
            messages.extend(self._read_waiting())
        if self.local_source is not None:
            messages.extend(self.local_source())
        if self.tp_size > 1:
            messages = broadcast_pyobj(messages)
        return messages

    def take(self, msg_type: type) -> bool:
        """Rank 0 of stage 0 only (False elsewhere, at once): read what waits on the socket
        into the backlog and take out every message of ``msg_type``; True when there was one.
        No collective runs, so it may be called while the other ranks do something else."""
        if self.socket is None or self.pp_rank > 0:
            return False
        self.backlog.extend(self._read_waiting())
        kept = [m for m in self.backlog if not isinstance(m, msg_type)]
        found = len(kept) < len(self.backlog)
        self.backlog = kept
        return found

    def _read_waiting(self) -> list[Any]:
        messages: list[Any] = []
        while True:
            try:
                messages.append(self.socket.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages
