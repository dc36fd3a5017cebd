"""The PS-mode transport: gRPC (chosen by measurement, README "PS mode") with one generic unary method whose
request and reply are :mod:`hpc_elastic.ps.wire` messages, so no protobuf code is generated.

A server is a mapping from operation names to handlers ``(header, arrays) -> (header, arrays)``; the client sends
``{"op": name, ...}``. A handler's ``ValueError`` comes back to the caller as :class:`RemoteError` (its message), and
so does a request that lacks a field (``KeyError``) or has one of the wrong type (``TypeError``); any other exception
is a bug of the server and reaches the caller as gRPC's UNKNOWN status.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc
import numpy.typing as npt

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.ps import wire

SERVICE = "hpc_elastic.ps.Service"
METHOD = f"/{SERVICE}/Call"
#: messages up to 256 MiB (gRPC's default is 4 MiB)
MAX_MESSAGE = 256 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]

Reply = tuple[dict[str, Any], Mapping[str, npt.NDArray[Any]]]
Handler = Callable[[dict[str, Any], wire.Arrays], Reply]


class RemoteError(HpcElasticError):
    """The peer refused a request (its handler raised ValueError); the message is the peer's."""


class Moved(ValueError):
    """Raised by a handler whose data has moved (a PS frozen for a re-partition): the caller should ask the master
    where it is now and try again. The client raises :class:`PeerMoved`."""


class PeerMoved(RemoteError):
    """The peer's data has moved (it raised :class:`Moved`)."""


class PeerUnavailable(HpcElasticError):
    """The peer did not answer (gone, or not started yet)."""


def address(host: str, port: int) -> str:
    """``host:port`` as gRPC and the clients read it: an IPv6 host in brackets."""
    bare = host.removeprefix("[").removesuffix("]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _check_local_address(host: str, port: int) -> None:
    """Refuse, in one line, a ``host`` that does not resolve or is not an address of this machine (gRPC's C core
    would log its own line about it first): it is resolved, and a socket is bound to it on a free port."""
    try:
        family, kind, _, _, sockaddr = socket.getaddrinfo(
            host.removeprefix("[").removesuffix("]"), port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind) as probe:
            probe.bind((sockaddr[0], 0, *sockaddr[2:]))
    except (OSError, UnicodeError, OverflowError, ValueError) as exc:  # (gaierror is an OSError)
        reason = getattr(exc, "strerror", None) or exc
        raise HpcElasticError(f"cannot listen on {address(host, port)}: {reason}") from None


def serve(
    handlers: Mapping[str, Handler], port: int = 0, host: str = "127.0.0.1", threads: int = 8
) -> tuple[grpc.Server, int]:
    """Start a server for ``handlers`` on ``host:port`` (0: a free port); the server and the port it listens on."""

    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        header, arrays = wire.decode(request)
        op = header.get("op")
        handler = handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return wire.encode({"error": f"unknown operation {op!r}"})
        try:
            reply, out = handler(header, arrays)
        except Moved as exc:
            return wire.encode({"error": str(exc), "moved": True})
        except ValueError as exc:
            return wire.encode({"error": str(exc)})
        except (KeyError, TypeError) as exc:  # a field the request lacks, or of the wrong type
            return wire.encode({"error": f"malformed {op} request: {type(exc).__name__}: {exc}"})
        return wire.encode(reply, out)

    _check_local_address(host, port)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
    rpc = grpc.unary_unary_rpc_method_handler(call)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Call": rpc}),))
    try:
        bound = server.add_insecure_port(address(host, port))
    except RuntimeError:  # gRPC's refusal of an address it cannot bind (not an address, not this host's)
        bound = 0
    if bound == 0:
        raise HpcElasticError(f"cannot listen on {address(host, port)}")
    server.start()
    return server, bound


class Client:
    """Calls to one peer at ``address`` (``host:port``). A call waits for the peer to be reachable (up to
    ``timeout``) unless ``wait_for_ready`` is false: then a peer that refuses the connection (its process gone) fails
    the call at once with :class:`PeerUnavailable`."""

    def __init__(self, address: str, timeout: float = 60.0, wait_for_ready: bool = True) -> None:
        self.address = address
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self._channel = grpc.insecure_channel(address, options=OPTIONS)
        self._call = self._channel.unary_unary(METHOD)

    def call(
        self, op: str, header: Mapping[str, Any] | None = None, arrays: Mapping[str, npt.NDArray[Any]] | None = None
    ) -> tuple[dict[str, Any], wire.Arrays]:
        request = wire.encode({**(header or {}), "op": op}, arrays)
        try:
            data: bytes = self._call(request, timeout=self.timeout, wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}:
                raise PeerUnavailable(f"{self.address} did not answer {op}: {code}") from exc
            raise
        reply, out = wire.decode(data)
        if "error" in reply and reply.get("moved"):
            raise PeerMoved(f"{self.address} refused {op}: {reply['error']}")
        if "error" in reply:
            raise RemoteError(f"{self.address} refused {op}: {reply['error']}")
        return reply, out

    def close(self) -> None:
        self._channel.close()
