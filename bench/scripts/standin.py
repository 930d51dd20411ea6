"""A stand-in OpenAI completions server that streams tokens as fast as it can (overhead measurement only).

Not a model and not a test double for vLLM: rig's tests run against real vLLM. This exists so
bench/scripts/overhead.py can measure how many streamed tokens per second our client can take
when the server is never the bottleneck. Every request streams ``max_tokens`` one-token SSE
events (with a ``: keep-alive`` comment every 64, as proxies and vLLM send), then usage and
``[DONE]``, over chunked HTTP/1.1 keep-alive connections.

    python bench/scripts/standin.py --port 8123 [--burst 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json

EVENT = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n'
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"connection: keep-alive\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


BURST = 1  # SSE events per write (--burst): 1 = one network write per token, the client's worst case


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            n = int(body.get("max_tokens", 16))
            writer.write(HEAD)
            for i in range(0, n, BURST):
                events = b"".join(EVENT if (i + j) % 64 else b": keep-alive\n\n" + EVENT
                                  for j in range(min(BURST, n - i)))
                writer.write(chunk(events))
                if BURST > 1 or i % 16 == 15:
                    await writer.drain()
            usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}}
            writer.write(chunk(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    print(f"standin listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--burst", type=int, default=1, help="SSE events per write")
    args = ap.parse_args()
    BURST = args.burst
    asyncio.run(serve(args.port))
