"""Replicas behind the data-parallel router on CPU: prefix-cache hit rate by routing policy,
throughput against one engine, and a replica killed mid-run.

    python benchmarks/bench_router.py [--questions 96] [--concurrency 8] [--max-tokens 8] [--simulate-only]
                                      [--ray] [--arms 0 4] [--threads-per-replica N] [--device cpu]
                                      [--stream FILE] [--model FOLDER --load-format dummy]
    python benchmarks/bench_router.py --save-stream FILE [--save-model-folder FOLDER]

For a machine without MiniLM, the embedded GGUF or a network (benchmarks/rag_stream_file.py):
``--save-stream`` writes the whole stream's chat messages and ``--save-model-folder`` the
embedded model's config and tokenizer (no weights), then exit; there, ``--stream FILE --model
FOLDER --load-format dummy`` posts and simulates the same requests, tokenized alike (the same
block hashes, so the same hit rates) by a SmolLM2-135M-shaped model on random weights.

First a simulation over the whole stream (no model: the router's own ReplicaChooser over the
requests' block hashes, each replica's cache the blocks sent to it, unbounded; ``--concurrency``
requests in flight, the oldest finishing as a new one arrives): the block hit rate of one
cache, round-robin and prefix affinity at several cache thresholds, and how evenly affinity
spreads the requests. Then the live run:

The embedded SmolLM2-135M-Instruct (or ``--model``); the pydoc-topics RAG stream (benchmarks/rag_stream.py:
MiniLM top-5 chunks per question, through the canonicalizer, as chat messages). Servers run
one after another, each a `pagedrag serve` subprocess (the router and its replicas for
--data-parallel-size 2); each takes the whole stream from ``--concurrency`` concurrent
clients (saturating: more than the replicas run at once). Arms:

- one replica (`pagedrag serve`);
- 2 replicas, round-robin;
- 2 replicas, prefix affinity (the default policy);
- 2 replicas, prefix affinity, one replica SIGKILLed halfway through (the router restarts it);
- with ``--ray``: 2 replicas on Ray Serve (pagedrag.router.ray_app, a local Ray instance).

Per arm: prefix-cache hit rate (prefix_cache_hits / prompt tokens, the replicas' sums from
/metrics), requests failed, tokens generated (every reply ``--max-tokens`` long: ignore_eos,
as random weights end early), generated tokens per second. Prints a markdown table. Every
replica (the lone one too) gets ``--threads-per-replica`` CPU threads (default ``cores / 2``)
through `pagedrag serve --cpu-threads`: the comparison is per replica, and 2 replicas need the
cores of 2; leave cores over for the router and the clients (16 cores: 4 threads). Replicas
are not pinned: the OS spreads their threads over the cores.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from rag_stream_file import load_stream, save_model_folder, save_stream, stream_messages  # noqa: E402

from pagedrag.router.affinity import AffinityThresholds, ReplicaChooser  # noqa: E402
from pagedrag.router.prompt_blocks import PromptBlocks  # noqa: E402
from pagedrag.server.background import free_port  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENGINE_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30), "--log-level", "warning"]


RAY_APPLICATION = """
import signal, sys, time
import ray
from ray import serve
from pagedrag.router.ray_app import build_app
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit through ray.shutdown
ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
serve.start(http_options={"port": int(sys.argv[1])})
serve.run(build_app({"num_replicas": 2, "num_cpus": 1, "max_model_len": 2048,
                     "kv_cache_memory_bytes": 1 << 30}), route_prefix="/")
while True:
    time.sleep(60)
"""


class Server:
    """A server subprocess (`pagedrag serve ...`, or the Ray Serve application) on ``port``,
    up with ``replicas`` replicas until closed."""

    def __init__(self, command: list[str], port: int, threads: int, log: Path, replicas: int):
        self.url = f"http://127.0.0.1:{port}"
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.log = log
        self._wait_up(replicas)

    @classmethod
    def serve(cls, flags: list[str], threads: int, log: Path) -> "Server":
        port = free_port()
        command = [sys.executable, "-m", "pagedrag", "serve", "--port", str(port), *flags]
        return cls(command, port, threads, log, replicas=2 if "--data-parallel-size" in flags else 1)

    @classmethod
    def ray(cls, threads: int, log: Path) -> "Server":
        port = free_port()
        return cls([sys.executable, "-c", RAY_APPLICATION, str(port)], port, threads, log, replicas=2)

    def _wait_up(self, replicas: int, timeout: float = 900) -> None:
        """Until /health answers and /metrics has every replica's series."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and self._replicas() >= replicas:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server did not come up: {self.log.read_text()[-2000:]}")

    def _replicas(self) -> int:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        labels = {s.labels.get("replica") for family in text_string_to_metric_families(text) for s in family.samples}
        return max(len(labels - {None}), 1)

    def counters(self) -> dict[str, float]:
        """The summed counters (no replica label) by sample name."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if "replica" not in s.labels}

    def replica_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def chat_bodies(messages: list[list[dict]], max_tokens: int) -> list[dict]:
    """The request bodies: greedy, and exactly ``max_tokens`` long (ignore_eos) whatever the weights."""
    return [{"model": MODEL, "messages": m, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for m in messages]


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The flags of every `pagedrag serve` the run starts (replicas and the lone server): the
    model and its weights, the device, each replica's threads. A ``--model`` is served under
    MODEL's name, which the bodies ask for."""
    flags = [*ENGINE_FLAGS, "--device", args.device, "--cpu-threads", str(args.threads_per_replica),
             "--load-format", args.load_format]
    if args.model is not None:
        flags = [args.model, "--served-model-name", MODEL, *flags]
    return flags


def run_stream(server: Server, bodies: list[dict], concurrency: int, kill_halfway: bool) -> dict:
    before = server.counters()
    done = threading.Semaphore(0)

    def ask(body: dict) -> int:
        try:
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
            return reply.json()["usage"]["completion_tokens"] if reply.status_code == 200 else -1
        except httpx.HTTPError:
            return -1
        finally:
            done.release()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(ask, body) for body in bodies]
        if kill_halfway:
            for _ in range(len(bodies) // 2):
                done.acquire()
            os.kill(server.replica_pids()[0], signal.SIGKILL)
        tokens = [future.result() for future in futures]
    seconds = time.perf_counter() - start
    after = server.counters()
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    generated = sum(t for t in tokens if t > 0)
    return {"hit": delta["pagedrag:prefix_cache_hits_total"] / delta["pagedrag:prompt_tokens_total"],
            "failed": sum(t < 0 for t in tokens), "tokens": generated, "tok_s": generated / seconds,
            "seconds": seconds}


def simulate(bodies: list[dict], concurrency: int, model: str | None) -> None:
    """Print the simulation table (see the module docstring); ``model``'s tokenizer gives the
    block hashes, as it does in the router."""
    blocks = PromptBlocks(model, 16)
    requests = [blocks.of("/v1/chat/completions", body) for body in bodies]
    arms = [("one engine", None, 1), ("2 replicas, round-robin", ReplicaChooser("round_robin"), 2)]
    arms += [(f"2 replicas, prefix affinity, cache_threshold {t}",
              ReplicaChooser(thresholds=AffinityThresholds(cache_threshold=t)), 2) for t in (0.5, 0.3, 0.1, 0.0)]
    print(f"\nSimulation: {len(requests)} requests, {concurrency} in flight\n")
    print("| routing | block hit rate | requests per replica |")
    print("|---|---|---|")
    for name, chooser, replicas in arms:
        hit, counts = _simulated(requests, chooser, replicas, concurrency)
        print(f"| {name} | {hit:.1%} | {' / '.join(map(str, counts))} |")


def _simulated(requests: list[list[bytes]], chooser: ReplicaChooser | None, replicas: int,
               concurrency: int) -> tuple[float, list[int]]:
    caches = [set() for _ in range(replicas)]
    in_flight: collections.deque = collections.deque()
    loads, counts, hits, total = [0] * replicas, [0] * replicas, 0, 0
    for hashes in requests:
        if len(in_flight) >= concurrency:
            loads[in_flight.popleft()] -= 1
        replica = chooser.choose(hashes, dict(enumerate(loads))) if chooser else 0
        if chooser:
            chooser.record(replica, hashes)
        hits += next((i for i, h in enumerate(hashes) if h not in caches[replica]), len(hashes))
        total += len(hashes)
        caches[replica].update(hashes)
        in_flight.append(replica)
        loads[replica] += 1
        counts[replica] += 1
    return hits / total, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--ray", action="store_true", help="add 2 replicas on Ray Serve (pip install 'ray[serve]')")
    parser.add_argument("--arms", type=int, nargs="+", default=None, help="run only these arms (0-based)")
    cores = os.cpu_count() or 1
    parser.add_argument("--threads-per-replica", type=int, default=max(cores // 2, 1),
                        help="CPU threads of each replica, the lone one too (default: cores / 2)")
    parser.add_argument("--device", default="cpu", help="every server's --device (default: cpu)")
    parser.add_argument("--model", default=None, help="a model folder for every server (default: the embedded "
                                                      "model); not the Ray arm's")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights (a folder from --save-model-folder has none)")
    parser.add_argument("--stream", type=Path, default=None, help="read the requests from this --save-stream file")
    parser.add_argument("--save-stream", type=Path, default=None, metavar="FILE",
                        help="write the whole stream's requests to FILE and exit")
    parser.add_argument("--save-model-folder", type=Path, default=None, metavar="FOLDER",
                        help="write the embedded model's config and tokenizer (no weights) to FOLDER and exit")
    args = parser.parse_args()
    if args.save_stream or args.save_model_folder:
        if args.save_stream:
            save_stream(args.save_stream, stream_messages())
        if args.save_model_folder:
            save_model_folder(args.save_model_folder)
        return
    messages = load_stream(args.stream) if args.stream else stream_messages()
    simulate(chat_bodies(messages, args.max_tokens), args.concurrency, args.model)  # the whole stream
    if args.simulate_only:
        return
    bodies = chat_bodies(messages[:args.questions], args.max_tokens)
    threads = args.threads_per_replica
    flags = serve_flags(args)
    arms = [("one replica", partial(Server.serve, flags), False),
            ("2 replicas, round-robin", partial(Server.serve, [*flags, "--data-parallel-size", "2",
                                                               "--router-policy", "round_robin"]), False),
            ("2 replicas, prefix affinity", partial(Server.serve, [*flags, "--data-parallel-size", "2"]), False),
            ("2 replicas, prefix affinity, one killed halfway",
             partial(Server.serve, [*flags, "--data-parallel-size", "2"]), True)]
    if args.ray:
        arms.append(("2 replicas on Ray Serve, prefix affinity", Server.ray, False))
    arms = [arm for number, arm in enumerate(arms) if args.arms is None or number in args.arms]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for number, (name, start, kill) in enumerate(arms):
            server = start(threads, Path(folder) / f"arm{number}.log")
            try:
                rows.append((name, run_stream(server, bodies, args.concurrency, kill)))
                print(f"arm done: {name}: {rows[-1][1]}", flush=True)  # a run cut short keeps its arms
            finally:
                server.close()
    single = rows[0][1]["tok_s"]
    print(f"\n{len(bodies)} questions, {args.concurrency} concurrent clients, {args.max_tokens} tokens each, "
          f"{cores} cores, {threads} threads per replica, {args.model or MODEL} ({args.load_format} weights)\n")
    print("| arm | prefix-cache hit rate | failed requests | tokens generated | tokens/s | vs one replica |")
    print("|---|---|---|---|---|---|")
    for name, row in rows:
        ratio = f"{row['tok_s'] / single:.2f}x" if single else "-"  # the lone replica failed every request
        print(f"| {name} | {row['hit']:.1%} | {row['failed']} | {row['tokens']} | {row['tok_s']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
