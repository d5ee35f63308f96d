"""POST /v1/warm through a router of engine replicas: the warm-up goes to every replica up, all
at once, so that each replica's pool holds the prompts' KV (not only the disk tier they may
share), and one answer comes once every replica has answered. Each router gathers its replicas'
``WarmAnswer``s and ``combined`` answers for all: router.data_parallel over HTTP
(``warm_every_replica``), router.ray_app through its deployment handle's broadcast.

Invariants:
- Each replica up is sent the request once, with the caller's headers (so every replica checks
  its API key, as on any route); a replica that fails is reported in the answer, not retried
  (every other replica had its own copy of the request).
- A client error (4xx) from any replica is the answer, as that replica gave it: the replicas
  check a request identically, so a bad request is never turned into a 200.
- Else 200 if at least one replica warmed: the replicas' counts (WarmResponse's) summed over
  those that warmed, as the deployment ran them (a prompt warmed on two replicas counts twice),
  and ``replicas``: one entry per replica sent the request, in the order the router gives them,
  with ``replica`` (its name), ``status`` and its own answer's fields (its counts, or its
  ``error``).
- Else (none warmed) the first replica's error answer as it gave it, a replica that did not
  answer counting as the router's 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi.responses import JSONResponse

from pagedrag.router.metrics_sum import sum_fields
from pagedrag.server.errors import APIError

if TYPE_CHECKING:
    from pagedrag.router.data_parallel import LocalReplica

WARM_PATH = "/v1/warm"


@dataclass(frozen=True)
class WarmAnswer:
    """One replica's answer: its HTTP status and its JSON object (an OpenAI error body when it
    gave none)."""

    replica: str
    status: int
    body: dict

    @classmethod
    def of(cls, replica: str, status: int, content: bytes) -> WarmAnswer:
        """From the reply's status and body; a body that is not a JSON object becomes an
        OpenAI error body carrying its text."""
        try:
            parsed = json.loads(content)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            parsed = APIError(status, content.decode(errors="replace")).body.model_dump()
        return cls(replica, status, parsed)

    @classmethod
    def unanswered(cls, replica: str, error: BaseException) -> WarmAnswer:
        """A replica that gave no answer (unreachable, died mid-reply): the router's 503."""
        failed = APIError(503, f"replica {replica} did not answer: {error!r}", code="service_unavailable")
        return cls(replica, failed.status, failed.body.model_dump())

    def entry(self) -> dict:
        return {"replica": self.replica, "status": self.status, **self.body}


async def warm_every_replica(client: httpx.AsyncClient, live: Sequence[LocalReplica], body: bytes,
                             headers: Mapping[str, str]) -> JSONResponse:
    """The warm-up ``body`` sent to every replica of ``live`` (at least one) at once, answered
    as the module's invariants say, in the order of ``live``."""
    return combined(await asyncio.gather(*(_ask(client, replica, body, headers) for replica in live)))


async def _ask(client: httpx.AsyncClient, replica: LocalReplica, body: bytes,
               headers: Mapping[str, str]) -> WarmAnswer:
    """The replica's answer, counted in its requests in flight while it is asked."""
    replica.in_flight += 1
    try:
        reply = await client.post(replica.url + WARM_PATH, content=body, headers=headers)
    except httpx.HTTPError as error:
        return WarmAnswer.unanswered(replica.name, error)
    finally:
        replica.in_flight -= 1
    return WarmAnswer.of(replica.name, reply.status_code, reply.content)


def combined(answers: Sequence[WarmAnswer]) -> JSONResponse:
    """One answer for the replicas' (at least one), as the module's invariants say."""
    refused = [answer for answer in answers if 400 <= answer.status < 500]
    warmed = [answer for answer in answers if answer.status == 200]
    if refused or not warmed:
        first = (refused or answers)[0]
        return JSONResponse(first.body, status_code=first.status)
    return JSONResponse({**sum_fields([answer.body for answer in warmed]),
                         "replicas": [answer.entry() for answer in answers]})
