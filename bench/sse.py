"""The one client of the OpenAI endpoint's streams (server-sent events) for the
tests, the bench, the demo and the proofs: the request, and the stream's events
parsed in order up to its ``[DONE]``. What a caller keeps of each event (token
ids, arrival times, text, usage, errors) is its own. Standard library only.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable, Iterator

# The event that ends a stream (the OpenAI API's "data: [DONE]"): events() yields it last.
DONE = "[DONE]"


def request(url: str, body: dict) -> urllib.request.Request:
    """A POST of body as JSON to url (pass it to urllib.request.urlopen)."""
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def stream_body(body: dict) -> dict:
    """body as a streamed request whose chunks carry their token ids (vLLM's
    return_token_ids extension) and whose last chunk carries the usage."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def events(resp: Iterable[bytes]) -> Iterator[dict | str]:
    """The events of a stream, each "data:" line's JSON object in order, then
    DONE if the stream sent it (nothing is read after it). Lines that carry no
    data (blank separators, comments, other fields) are skipped. A line that is
    not UTF-8, or data that is not JSON, raises ValueError (UnicodeDecodeError,
    json.JSONDecodeError)."""
    for raw in resp:
        line = raw.decode().rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == DONE:
            yield DONE
            return
        yield json.loads(data)
