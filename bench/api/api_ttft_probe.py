"""Time to the first text through `ovshard api`: a raw socket client against the official `openai` client.

Run: .venv/bin/python bench/api/api_ttft_probe.py BUNDLE   (a compiled 2-stage bundle, e.g. stories260K fp32)
Prints the fastest 4 of 8 requests each, in ms: how much of the API's first-token time is the client's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from api_server import Api  # noqa: E402  (stage workers plus an `ovshard api` process)

BODY = {"prompt": [1, 400, 300], "max_tokens": 4, "temperature": 0, "stream": True}


def raw(api: Api) -> float:
    host, port = api.address.rsplit(":", 1)
    payload = json.dumps({"model": api.client.models.list().data[0].id, **BODY}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {api.address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as c:
        start = time.perf_counter()
        c.sendall(head + payload)
        seen = b""
        while not any(_has_text(event) for event in seen.split(b"\n\n")):
            seen += c.recv(65536)
        return 1000 * (time.perf_counter() - start)


def _has_text(event: bytes) -> bool:
    """A whole `data: {...}` event whose choice carries text (the first event of a stream carries none)."""
    start = event.find(b"data: {")
    try:
        return start >= 0 and bool(json.loads(event[start + 6:])["choices"][0]["text"])
    except (ValueError, KeyError, IndexError):
        return False


def client(api: Api) -> float:
    model = api.client.models.list().data[0].id
    start = time.perf_counter()
    for chunk in api.client.completions.create(model=model, **BODY):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].text:
            break
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a compiled 2-stage bundle")
    api = Api(parser.parse_args().bundle, "--streams", "2")
    try:
        for name, probe in (("raw socket", raw), ("openai client", client)):
            print(name, sorted(round(probe(api), 1) for _ in range(8))[:4])
    finally:
        api.stop()


if __name__ == "__main__":
    main()
