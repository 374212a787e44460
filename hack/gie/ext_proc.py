"""A client of Envoy's external-processing gRPC service (``envoy.service.ext_proc.v3``), speaking
to the Gateway API Inference Extension's endpoint picker (EPP) as Envoy's ``ext_proc`` filter does
in the upstream standalone chart (``processing_mode``: headers SEND, bodies FULL_DUPLEX_STREAMED).

One request is one bidirectional ``Process`` stream:

1. send ``request_headers`` (``:method``, ``:path``, ...) then ``request_body`` with
   ``end_of_stream``; the EPP schedules and answers a ``request_headers`` response whose header
   mutation sets ``x-gateway-destination-endpoint: <podIP>:<port>`` (and the same key in the
   ``envoy.lb`` dynamic metadata), then the body back;
2. the caller sends the HTTP request to that endpoint itself (Envoy's ``ORIGINAL_DST`` cluster);
3. send ``response_headers`` and ``response_body`` (``end_of_stream``) so the EPP's request
   bookkeeping (in-flight load, prefix-cache index) completes, and read its answers.

The messages are a subset of the upstream protos (``envoy/service/ext_proc/v3/
external_processor.proto``, ``envoy/config/core/v3/base.proto`` at go-control-plane
envoy v1.37.0: same field numbers and types), built at import into a private descriptor pool,
so no generated stubs or protoc are needed; fields outside the subset are skipped as unknown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DESTINATION_HEADER = "x-gateway-destination-endpoint"

_T = descriptor_pb2.FieldDescriptorProto
# message -> [(field, number, type, label, message type)]; numbers from the upstream protos.
_MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    "HeaderValue": [("key", 1, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
                    ("value", 2, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
                    ("raw_value", 3, _T.TYPE_BYTES, _T.LABEL_OPTIONAL, "")],
    "HeaderMap": [("headers", 1, _T.TYPE_MESSAGE, _T.LABEL_REPEATED, "HeaderValue")],
    "HeaderValueOption": [("header", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HeaderValue")],
    "HttpHeaders": [("headers", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HeaderMap"),
                    ("end_of_stream", 3, _T.TYPE_BOOL, _T.LABEL_OPTIONAL, "")],
    "HttpBody": [("body", 1, _T.TYPE_BYTES, _T.LABEL_OPTIONAL, ""),
                 ("end_of_stream", 2, _T.TYPE_BOOL, _T.LABEL_OPTIONAL, "")],
    "ProcessingRequest": [("request_headers", 2, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HttpHeaders"),
                          ("response_headers", 3, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HttpHeaders"),
                          ("request_body", 4, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HttpBody"),
                          ("response_body", 5, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HttpBody")],
    "HeaderMutation": [("set_headers", 1, _T.TYPE_MESSAGE, _T.LABEL_REPEATED, "HeaderValueOption"),
                       ("remove_headers", 2, _T.TYPE_STRING, _T.LABEL_REPEATED, "")],
    "CommonResponse": [("status", 1, _T.TYPE_INT32, _T.LABEL_OPTIONAL, ""),
                       ("header_mutation", 2, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HeaderMutation")],
    "HeadersResponse": [("response", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "CommonResponse")],
    "BodyResponse": [("response", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "CommonResponse")],
    "HttpStatus": [("code", 1, _T.TYPE_INT32, _T.LABEL_OPTIONAL, "")],
    "ImmediateResponse": [("status", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HttpStatus"),
                          ("body", 3, _T.TYPE_BYTES, _T.LABEL_OPTIONAL, ""),
                          ("details", 5, _T.TYPE_STRING, _T.LABEL_OPTIONAL, "")],
    "ProcessingResponse": [("request_headers", 1, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HeadersResponse"),
                           ("response_headers", 2, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "HeadersResponse"),
                           ("request_body", 3, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "BodyResponse"),
                           ("response_body", 4, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "BodyResponse"),
                           ("immediate_response", 7, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, "ImmediateResponse")],
}
_PACKAGE = "shardline.extproc_subset"


def _build() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(name="shardline_extproc_subset.proto", package=_PACKAGE,
                                               syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = proto.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in _MESSAGES}


_M = _build()
ProcessingRequest = _M["ProcessingRequest"]
ProcessingResponse = _M["ProcessingResponse"]


class PickRefused(RuntimeError):
    """The EPP answered with an immediate response (e.g. 503: no endpoint to pick)."""

    def __init__(self, code: int, details: str):
        super().__init__(f"endpoint picker refused the request: HTTP {code} {details}")
        self.code = code


def _headers(pairs: dict[str, str], end_of_stream: bool = False):
    values = [_M["HeaderValue"](key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return _M["HttpHeaders"](headers=_M["HeaderMap"](headers=values), end_of_stream=end_of_stream)


@dataclass
class Pick:
    """An open ``Process`` stream whose request the EPP has scheduled to ``endpoint``
    (``"<podIP>:<port>"``); :meth:`finish` reports the response and closes it."""

    endpoint: str
    call: Any

    async def finish(self, status: int, body: bytes, content_type: str = "text/event-stream") -> None:
        """Send the upstream response (status, one body chunk, end of stream) and drain the
        EPP's answers until it closes the stream."""
        await self.call.write(ProcessingRequest(response_headers=_headers(
            {":status": str(status), "status": str(status), "content-type": content_type})))
        await self.call.write(ProcessingRequest(response_body=_M["HttpBody"](body=body, end_of_stream=True)))
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass


class EppClient:
    """Picks endpoints from an EPP's ext-proc port (``target`` ``"host:port"``, plaintext:
    run the EPP with ``--secure-serving=false``)."""

    def __init__(self, target: str):
        self._channel = grpc.aio.insecure_channel(target)
        self._process = self._channel.stream_stream(METHOD, request_serializer=ProcessingRequest.SerializeToString,
                                                    response_deserializer=ProcessingResponse.FromString)

    async def pick(self, path: str, body: dict, headers: dict[str, str] | None = None) -> Pick:
        """Schedule one HTTP ``POST path`` with JSON ``body``; returns the open :class:`Pick`.

        Raises:
            PickRefused: the EPP answered an immediate response (no endpoint, bad request).
            grpc.aio.AioRpcError: the stream failed.
        """
        raw = json.dumps(body).encode()
        call = self._process()
        await call.write(ProcessingRequest(request_headers=_headers(
            {":method": "POST", ":path": path, ":authority": "gateway", "content-type": "application/json",
             **(headers or {})})))
        await call.write(ProcessingRequest(request_body=_M["HttpBody"](body=raw, end_of_stream=True)))
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                raise PickRefused(0, "stream closed before a pick")
            kind = _kind(resp)
            if kind == "immediate_response":
                r = resp.immediate_response
                call.cancel()
                raise PickRefused(r.status.code, r.details or r.body.decode(errors="replace"))
            if kind == "request_headers":
                for opt in resp.request_headers.response.header_mutation.set_headers:
                    if opt.header.key.lower() == DESTINATION_HEADER:
                        endpoint = (opt.header.raw_value or opt.header.value.encode()).decode()
                        return Pick(endpoint, call)
                call.cancel()
                raise PickRefused(0, f"request_headers response without {DESTINATION_HEADER}")

    async def close(self) -> None:
        await self._channel.close()


def _kind(resp) -> str:
    for name in ("immediate_response", "request_headers", "request_body", "response_headers", "response_body"):
        if resp.HasField(name):
            return name
    return ""


def epp_router(client: EppClient, path: str = "/v1/chat/completions"):
    """A router for ``tests/serving/smg_gateway.replay``: each request is picked by the EPP,
    sent to ``http://<endpoint>``, and its response reported back through ``Pick.finish``."""

    async def route(i: int, body: dict):
        pick = await client.pick(path, body)
        return f"http://{pick.endpoint}", pick.finish

    return route
