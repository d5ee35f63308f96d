"""The headers a router passes on, a request's to a replica and a reply's back to the caller
(router.data_parallel, router.ray_app): all but the hop-by-hop ones, which describe one
connection (its host, its framing) and are set anew on the next."""

from __future__ import annotations

from collections.abc import Collection, Mapping

HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})


def forwarded_headers(headers: Mapping[str, str], drop: Collection[str] = ()) -> dict[str, str]:
    """``headers`` without the hop-by-hop ones nor ``drop`` (lower-case names); a request's
    API key passes, so every replica checks it as on any route."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS and k.lower() not in drop}
