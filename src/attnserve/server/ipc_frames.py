"""Message framing between the HTTP process and the engine process (`attnserve.server.
engine_client`, `attnserve.server.engine_process`): ``multiprocessing.connection``'s
frames (a 4-byte big-endian length, or -1 and an 8-byte one, then the bytes), so the engine
process reads and writes them with a plain ``Connection`` while the HTTP process reads them
on its asyncio event loop (`FrameProtocol`) and writes them through the loop's transport.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Optional


def frame(data: bytes) -> bytes:
    """``data`` with ``multiprocessing.connection``'s length header."""
    n = len(data)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + data


class FrameProtocol(asyncio.Protocol):
    """Splits the byte stream from the engine process into messages (see `frame`)."""

    def __init__(self, on_message, on_lost):
        self.on_message = on_message
        self.on_lost = on_lost
        self.buf = bytearray()
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        start = 0
        while len(buf) - start >= 4:
            (n,) = struct.unpack_from("!i", buf, start)
            head = 4
            if n == -1:
                if len(buf) - start < 12:
                    break
                (n,) = struct.unpack_from("!Q", buf, start + 4)
                head = 12
            if len(buf) - start < head + n:
                break
            msg = bytes(buf[start + head:start + head + n])
            start += head + n
            self.on_message(msg)
        del buf[:start]

    def connection_lost(self, exc) -> None:
        self.on_lost(exc)
