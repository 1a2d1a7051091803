"""A user-space TCP relay on a worker host of bench/netbed.py: the latency and lost connections this kernel's tc
cannot make. ``python -m bench.netproxy LISTEN_HOST:PORT TARGET_HOST:PORT CONTROL_FILE``

``CONTROL_FILE`` (JSON, re-read every 50 ms): ``delay_ms`` delays each chunk either way (order kept); ``reset``, a
counter, closes every open connection at once when it grows (in-flight data lost, as with a dropped route or NAT
state). Prints ``listening`` once bound and ``reset N`` per reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path


class Relay:
    def __init__(self, target: tuple[str, int], control: Path) -> None:
        self.target = target
        self.control = control
        self.delay_s = 0.0
        self.resets = 0
        self.open: set[asyncio.StreamWriter] = set()

    async def watch(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                settings = json.loads(self.control.read_text())
                self.delay_s = float(settings.get("delay_ms", 0)) / 1000
                resets = int(settings.get("reset", 0))
                if resets > self.resets:
                    self.resets = resets
                    for writer in list(self.open):
                        writer.transport.abort()
                    print(f"reset {resets}", flush=True)
            await asyncio.sleep(0.05)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await sender
            writer.transport.abort()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.open |= {writer, up_writer}
        try:
            await asyncio.gather(self.pipe(reader, up_writer), self.pipe(up_reader, writer))
        finally:
            self.open -= {writer, up_writer}


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def main(listen: str, target: str, control: str) -> None:
    relay = Relay(_address(target), Path(control))
    server = await asyncio.start_server(relay.serve, *_address(listen))
    print("listening", flush=True)
    async with server:
        await asyncio.gather(server.serve_forever(), relay.watch())


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: python -m bench.netproxy LISTEN_HOST:PORT TARGET_HOST:PORT CONTROL_FILE (got {sys.argv[1:]})")
    asyncio.run(main(*sys.argv[1:]))
