"""A client process for tests/test_server_load.py: builds large request bodies once, then each time a line
arrives on stdin sends them all at once to the server and prints one JSON line with the answers.

Its own process, as a real client would be: its JSON encoding and socket writes do not share the server's GIL.
usage: python big_body_sender.py URL PATH NUM_BODIES NUM_BYTES
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import httpx


def body(path: str, seed: int, num_bytes: int) -> bytes:
    """A request whose text is `num_bytes` of random lowercase words (no two bodies alike)."""
    rng = random.Random(seed)
    words, size = [], 0
    while size < num_bytes:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(w)
        size += len(w) + 1
    text = " ".join(words)
    req = ({"messages": [{"role": "user", "content": text}]} if path.endswith("chat/completions")
           else {"prompt": text})
    return json.dumps({**req, "max_tokens": 4}).encode()


async def send_all(url: str, path: str, bodies: list[bytes]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(b: bytes) -> dict:
            r = await http.post(path, content=b, headers={"Content-Type": "application/json"})
            return {"status": r.status_code, "body": r.json()}

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def main() -> None:
    url, path, num_bodies, num_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    bodies = [body(path, i, num_bytes) for i in range(num_bodies)]
    print(json.dumps({"ready": [len(b) for b in bodies]}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(asyncio.run(send_all(url, path, bodies))), flush=True)


if __name__ == "__main__":
    main()
