"""Load over HTTP with a RAG workload: TTFT, inter-token latency and throughput,
with the prefix cache on and off.

Each request is a chat: one fixed system prompt, then a user turn holding 3-5
context chunks drawn from a pool (kept in pool order, the stable layout the
canonicalizer produces) and a question. Requests arrive as a Poisson process at
--rate requests/s and are streamed; every completion has exactly --max-tokens
tokens (ignore_eos), so runs are comparable.

    python benchmarks/load_http.py --num-requests 24 --rate 0.25     # starts `pagedrag serve` twice
    python benchmarks/load_http.py --base-url http://127.0.0.1:8000  # measures a running server

ITL samples are the gaps between streamed chunks (a chunk may rarely hold two
tokens when the client falls behind), as vLLM's benchmark_serving counts them.
"load avg" is the machine's 1-minute load average when a run ends: on a shared
machine, a run next to other work is slower than the engine is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from pagedrag.server.background import free_port

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Rail, a regional train operator. Answer the "
    "customer's question using only the numbered context passages. Quote the passage number "
    "you relied on in square brackets. If the passages do not contain the answer, say that you "
    "do not know and suggest contacting the ticket office. Keep answers short and polite, and "
    "never invent prices, times or rules that are not in the passages.")
CHUNKS = [
    "Tickets can be bought at station machines, in the Northwind app, or on board from the "
    "conductor. Buying on board costs a surcharge of two euros unless the station machine was "
    "out of order, which the conductor can check.",
    "Children under six travel free when accompanied by an adult. Children from six to fifteen "
    "pay half fare. Groups of ten or more can book a group ticket with a thirty percent discount "
    "at least three days before travel.",
    "Bicycles are allowed on all regional trains outside the morning peak between seven and nine "
    "on weekdays. A bicycle day ticket costs five euros. Folding bicycles that are folded count "
    "as luggage and travel free at any time.",
    "If a train is more than sixty minutes late, passengers can claim a refund of twenty-five "
    "percent of the fare; after one hundred and twenty minutes the refund is fifty percent. "
    "Claims must be filed within three months using the online form.",
    "Monthly passes are personal and must carry a photo. They are valid on every regional "
    "train within the chosen zones, and on buses of partner operators on weekends. A lost "
    "pass can be replaced once a year for a fee of ten euros.",
    "Dogs travel free when they are small enough to be carried in a bag. Larger dogs need a "
    "half-fare ticket and must be kept on a leash and muzzled. Assistance dogs always travel "
    "free and may accompany their owner in every coach.",
    "The quiet coach is at the front of every train. Phone calls, music without headphones, and "
    "group conversations are not allowed there. Staff may ask passengers who disturb others to "
    "move to another coach.",
    "Lost items found on trains are kept at the central station's lost property office for "
    "thirty days. Items can be collected on weekdays from nine to five with an identity "
    "document. Valuables are handed to the police after seven days.",
]
QUESTIONS = [
    "Can I take my bike on the 8:15 train on a Tuesday?",
    "How much does my ten-year-old pay?",
    "My train was 90 minutes late. What refund do I get?",
    "I lost my monthly pass, what now?",
    "Can my large dog come with me?",
    "Where can I make a phone call on the train?",
    "I left my umbrella on the train yesterday. Where is it?",
    "Is it more expensive to buy a ticket from the conductor?",
]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def rag_messages(rng: random.Random) -> list[dict]:
    picked = sorted(rng.sample(range(len(CHUNKS)), rng.randint(3, 5)))
    context = "\n\n".join(f"[{i + 1}] {CHUNKS[i]}" for i in picked)
    question = rng.choice(QUESTIONS)
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


async def one_request(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    result = Result(ok=False)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return Result(ok=False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(ok=False, error=chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.completion_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if result.ttft:
                    result.itls.append(now - last)
                else:
                    result.ttft = now - start
                last = now
    result.ok = result.completion_tokens > 0
    return result


async def run_workload(base_url: str, num_requests: int, rate: float, max_tokens: int,
                       seed: int) -> tuple[list[Result], float]:
    """Send the requests at Poisson arrival times; (results, seconds from first send to last end)."""
    rng = random.Random(seed)
    workload = [rag_messages(rng) for _ in range(num_requests)]
    gaps = [rng.expovariate(rate) for _ in range(num_requests)]
    limits = httpx.Limits(max_connections=num_requests + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, [{"role": "user", "content": "Warm up."}], 2)
        start = time.perf_counter()
        tasks = []
        for messages, gap in zip(workload, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, model, messages, max_tokens)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(label: str, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft for r in done]
    itls = [gap for r in done for gap in r.itls]
    prompt_tokens = sum(r.prompt_tokens for r in done)

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    return {"mode": label, "ok": len(done), "failed": len(results) - len(done),
            "prompt_tokens_mean": prompt_tokens / max(len(done), 1),
            "cache_hit_pct": 100 * sum(r.cached_tokens for r in done) / max(prompt_tokens, 1),
            "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
            "itl_p50_ms": pct(itls, 50), "itl_p99_ms": pct(itls, 99),
            "output_tok_s": sum(r.completion_tokens for r in done) / duration,
            "req_s": len(done) / duration, "duration_s": duration, "loadavg_1m": os.getloadavg()[0],
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


TABLE_HEADER = ("| prefix cache | ok/failed | prompt tok (mean) | cached % | TTFT p50 ms | TTFT p99 ms "
                "| ITL p50 ms | ITL p99 ms | output tok/s | req/s | duration s | load avg |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(s: dict) -> str:
    return (f"| {s['mode']} | {s['ok']}/{s['failed']} | {s['prompt_tokens_mean']:.0f} | {s['cache_hit_pct']:.1f} "
            f"| {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.0f} | {s['itl_p99_ms']:.0f} "
            f"| {s['output_tok_s']:.2f} | {s['req_s']:.3f} | {s['duration_s']:.1f} | {s['loadavg_1m']:.1f} |")


@contextlib.contextmanager
def serve(caching: bool, server_args: list[str], startup_timeout: float = 300.0) -> Iterator[str]:
    """`pagedrag serve` in a subprocess on a free port; yields its base URL."""
    port = free_port()
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    command = [sys.executable, "-m", "pagedrag", "serve", "--port", str(port), flag,
               "--log-level", "warning", *server_args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(base_url, process, startup_timeout)
            log.seek(0)
            print(f"# {' '.join(command[1:])}\n#   {_pool_line(log.read())}", file=sys.stderr)
            yield base_url
        finally:
            process.terminate()
            process.wait(timeout=60)


def _wait_healthy(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the server at {base_url} was not healthy after {timeout:.0f} s")


def _pool_line(log: str) -> str:
    return next((line for line in log.splitlines() if "blocks=" in line), "(no pool line in the log)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.25, help="mean arrivals per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", help="measure this running server instead of starting two")
    parser.add_argument("--server-args", default="--max-model-len 2048",
                        help="extra `pagedrag serve` flags (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="also print the summaries as JSON")
    args = parser.parse_args(argv)

    def measure(label: str, base_url: str) -> dict:
        results, duration = asyncio.run(run_workload(base_url, args.num_requests, args.rate,
                                                     args.max_tokens, args.seed))
        return summarize(label, results, duration)

    if args.base_url:
        summaries = [measure("external", args.base_url)]
    else:
        summaries = []
        for caching in (True, False):
            with serve(caching, args.server_args.split()) as base_url:
                summaries.append(measure("on" if caching else "off", base_url))
    print(TABLE_HEADER)
    for summary in summaries:
        print(table_row(summary))
    if args.json:
        print(json.dumps(summaries, indent=1))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
