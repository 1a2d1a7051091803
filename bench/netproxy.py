"""A user-space TCP relay for the test bed: latency and lost connections, which this kernel's tc cannot make.

    python -m bench.netproxy LISTEN_HOST:PORT TARGET_HOST:PORT CONTROL_FILE

It runs on a worker host (bench/netbed.py starts it there with the worker pointed at it) and relays every
connection to the broker. Its settings come from ``CONTROL_FILE``, a JSON object re-read every 50 ms:

- ``delay_ms``: each chunk read from either side is written to the other that much later (order kept), so a
  round trip takes twice as long more;
- ``reset``: a counter; when it grows, every open connection is closed at once (both sides: a lost route, a
  NAT or load balancer dropping its state). What was in flight is gone; the peers must notice and reconnect.

It prints ``listening`` once bound and one ``reset N`` line per reset.
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
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
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
    if len(sys.argv) == 1:  # a bare call (make bench runs every bench/*.py) is a request for the usage
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) != 4:
        print(f"netproxy: expected LISTEN TARGET CONTROL_FILE, got {sys.argv[1:]}", file=sys.stderr)
        sys.exit(2)
    asyncio.run(main(*sys.argv[1:]))
