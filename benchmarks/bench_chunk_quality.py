"""Chunk reuse's quality against full prefill, on several RAG streams.

    python benchmarks/bench_chunk_quality.py [--streams pydoc:5:relevance stdlib:8:stable ...]
        [--streams-file F] [--prompts 64] [--warmup 40] [--timed 16]
        [--arms first:0.15 first:0.15:64 deviation:0.3 oracle:0.15 ...] [--kl-only] [--isolated]
        [--kv-gib 16] [--budget-s S] [--json F]
    python benchmarks/bench_chunk_quality.py --save-streams F   # MiniLM's retrieval, once, to a file
    python benchmarks/bench_chunk_quality.py --report F         # the tables of a --json file

A stream is CORPUS:K:ORDER: the questions of benchmarks/rag_stream.py over ``pydoc`` (the
reference manual's topics) or ``stdlib`` (the standard library's module docstrings), each
with its K nearest chunks (MiniLM), through the canonicalizer (chat template,
``REUSABLE_CHUNK_TEMPLATE``) in ``relevance`` (retrieval) or ``stable`` order. With
``--streams-file`` the retrieval comes from a file ``--save-streams`` wrote (its top 8), so a
machine without MiniLM can run it. The embedded SmolLM2-135M-Instruct in float32.

Each arm is one engine, started cold on every stream (``reset_prefix_cache``), that runs the
``--warmup`` first prompts (their chunks get cached), then the ``--prompts`` measured ones,
each pass a single batched ``generate``:

- full prefill: exact prefix caching only (the reference; its greedy answers come from a
  cold cache, so that its teacher-forced pass computes them);
- chunk reuse without recompute (the cached KV kept as is), and each arm STRATEGY:FRACTION
  [:WINDOW]: FRACTION of each reused chunk's tokens recomputed, picked by STRATEGY
  (pagedrag.worker.recompute_selection: ``first`` or ``deviation``, or ``oracle``: the ideal
  of CacheBlend's selection, a bound for any way of picking tokens, measurement only: it
  costs a full prefill; it picks the tokens whose K/V, summed over every layer, each layer's
  squared change relative to its mean squared norm, differ most from full prefill's), and
  the last WINDOW imported tokens before the question too (``chunk_recompute_window``; no
  WINDOW: 0, none).

Per arm and stream, over the measured prompts that imported a cached chunk (the same ones in
every arm, however much of the chunk it recomputes): the share of prompt tokens
computed (all measured prompts); first-token agreement with the reference and exact match of
the first 8 and 32 greedy tokens (with ``--kl-only`` no greedy answers: first-token agreement
then reads the teacher-forced pass's argmax); the mean KL divergence KL(reference || arm) of
the next-token distribution over the first 16 answer positions, both fed the reference's
answer (teacher forcing); and TTFT against full prefill: the median wall time of a one-token
``generate`` over the ``--timed`` stream prompts after the measured ones, one at a time, each
engine after its own passes. Prints a markdown table per stream, then the range of each figure
over the streams; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rag_stream import SYSTEM_PROMPT, load_streams, rag_stream, save_streams  # noqa: E402

from pagedrag import LLM, SamplingParams  # noqa: E402
from pagedrag.models.loader import load_tokenizer  # noqa: E402
from pagedrag.rag.canonical import REUSABLE_CHUNK_TEMPLATE, PromptCanonicalizer  # noqa: E402
from pagedrag.worker import model_runner, recompute_selection  # noqa: E402

ANSWER_TOKENS = 32
SHORT_ANSWER = 8
KL_POSITIONS = 16
SAVED_TOP_K = 8
STREAMS = ["pydoc:3:relevance", "pydoc:5:relevance", "pydoc:8:stable",
           "stdlib:3:stable", "stdlib:5:relevance", "stdlib:8:relevance"]
NO_RECOMPUTE = "first:0"
ARMS = ["first:0.15", "first:1", "first:0.3", "first:0.15:64", "first:0.5", "first:0.3:64", "first:0.15:128",
        "deviation:0.15", "deviation:0.3"]


@dataclass(frozen=True)
class ArmSpec:
    """STRATEGY:FRACTION[:WINDOW] (fraction 0: no recompute)."""

    strategy: str
    fraction: float
    window: int = 0

    @classmethod
    def parse(cls, text: str) -> "ArmSpec":
        strategy, fraction, *window = text.split(":")
        if strategy not in ("first", "deviation", "oracle"):
            raise argparse.ArgumentTypeError(f"unknown strategy {strategy!r} in {text!r}")
        return cls(strategy, float(fraction), int(window[0]) if window else 0)

    @property
    def name(self) -> str:
        if not self.fraction and not self.window:
            return "no recompute"
        window = f" + last {self.window} before the question" if self.window else ""
        return f"{self.fraction:.0%} `{self.strategy}`{window}"


@dataclass
class Figures:
    """One arm on one stream (rates over the prompts that imported a chunk)."""

    computed: float
    reused: int
    first: float
    exact_short: float | None
    exact: float | None
    kl: float
    ttft_ms: float


class ForcedLogProbs:
    """The log-probs at the KL_POSITIONS rows before the last one of every request that
    completes its prompt in a step while ``on``: a teacher-forced prompt ends with KL_POSITIONS
    answer tokens, so those rows predict them. Keeps which row ends which request from the
    step's layout, and reads those rows of the forward pass's hidden states (eager or a CUDA
    graph's)."""

    def __init__(self, llm: LLM):
        runner = llm.llm_engine.runner
        self.model, self.ops = runner.model, runner.ops
        self.on = False
        self.log_probs: dict[str, torch.Tensor] = {}  # request id -> [KL_POSITIONS, vocab]
        self._ends: list[tuple[str, int, int]] = []  # (request id, its last row, its run's first row)
        runner.layout = self._keeping_ends(runner.layout)
        self.model.forward = self._reading(self.model.forward)
        if runner.graphs is not None:
            runner.graphs.run = self._reading(runner.graphs.run)

    def _keeping_ends(self, layout):
        def keep(step, inflight=None):
            out = layout(step, inflight)
            completing = [item.request.request_id for item in step.scheduled if item.completes_sequence]
            starts = out[0].starts
            self._ends = [(request_id, row, starts[bisect.bisect_right(starts, row) - 1])
                          for request_id, row in zip(completing, out[0].logits_rows)]
            return out
        return keep

    def _reading(self, forward):
        def read(*args, **kwargs):
            hidden = forward(*args, **kwargs)
            if self.on:
                for request_id, row, first in self._ends:
                    if row - first < KL_POSITIONS:
                        raise RuntimeError("a forced answer was split over steps: raise max_num_batched_tokens")
                    logits = self.model.compute_logits(hidden[row - KL_POSITIONS:row], self.ops)
                    self.log_probs[request_id] = torch.log_softmax(logits.float(), dim=-1)
            return hidden
        return read


class Arm:
    """One engine, run over stream after stream (cold each time)."""

    def __init__(self, engine: dict, **settings):
        self.llm = LLM(**engine, **settings)
        self.forced_rows = ForcedLogProbs(self.llm)

    def close(self) -> None:
        self.llm.llm_engine.shutdown()
        del self.llm, self.forced_rows
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def _generate(self, prompts: list[list[dict]], params: SamplingParams):
        return self.llm.generate([{"prompt_segments": segments} for segments in prompts], params, use_tqdm=False)

    def warm(self, prompts: list[list[dict]]) -> None:
        self._generate(prompts, SamplingParams(max_tokens=1))

    def forced(self, prompts: list[list[dict]], answers: list[list[int]]
               ) -> tuple[list[torch.Tensor], list[int], float]:
        """Each prompt fed its answer's first KL_POSITIONS tokens: per prompt, the log-probs
        [KL_POSITIONS, vocab] and the tokens of the chunks it imported (kept or recomputed);
        and the share of prompt tokens computed (the answers left out)."""
        fed = [segments + [{"token_ids": answer[:KL_POSITIONS], "reusable": False}]
               for segments, answer in zip(prompts, answers)]
        before = self.llm.stats()
        self.forced_rows.on = True
        try:
            outputs = self._generate(fed, SamplingParams(temperature=0, max_tokens=1))
        finally:
            self.forced_rows.on = False
        after = self.llm.stats()
        answered = KL_POSITIONS * len(fed)
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"] - answered
        total = after["prompt_tokens_total"] - before["prompt_tokens_total"] - answered
        log_probs = [self.forced_rows.log_probs.pop(out.request_id) for out in outputs]
        return log_probs, [out.num_chunk_hit_tokens + out.num_recomputed_tokens for out in outputs], computed / total

    def greedy(self, prompts: list[list[dict]]) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
        return [out.outputs[0].token_ids for out in self._generate(prompts, params)]

    def ttft_ms(self, prompts: list[list[dict]]) -> float:
        """Median wall time of a one-token generate, one prompt at a time."""
        times = []
        for segments in prompts:
            start = time.perf_counter()
            self._generate([segments], SamplingParams(temperature=0, max_tokens=1))
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)


@dataclass
class Stream:
    """A stream's prompts as segments: warm-up, measured and timed ones."""

    name: str
    warmup: list[list[dict]]
    measured: list[list[dict]]
    timed: list[list[dict]]


@dataclass
class Reference:
    answers: list[list[int]]
    log_probs: list[torch.Tensor]
    computed: float
    ttft_ms: float


def build_streams(names: list[str], retrieved: dict, tokenizer, args) -> list[Stream]:
    """The streams CORPUS:K:ORDER as segments (the canonicalizer's)."""
    streams = []
    for name in names:
        corpus, k, order = name.split(":")
        canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT, order=order, tokenizer=tokenizer,
                                            chunk_template=REUSABLE_CHUNK_TEMPLATE)
        end = args.warmup + args.prompts + args.timed
        built = [canonicalizer.build(question, [(c.source_id, c.text) for c in chunks[:int(k)]]).segments
                 for question, chunks in retrieved[corpus][:end]]
        if len(built) < end:
            raise ValueError(f"{name}: {len(built)} questions, {end} needed")
        warmup, measured = built[:args.warmup], built[args.warmup:args.warmup + args.prompts]
        if args.isolated:
            warmup = isolated_warmup(measured)
        streams.append(Stream(name, warmup, measured, built[args.warmup + args.prompts:]))
    return streams


def isolated_warmup(measured: list[list[dict]]) -> list[list[dict]]:
    """Every chunk of the measured prompts alone after the head (CacheBlend's setting)."""
    chunks = {tuple(s["token_ids"]) for segments in measured for s in segments if s["reusable"]}
    head = measured[0][0]
    return [[head, {"token_ids": list(chunk)}, {"token_ids": [198], "reusable": False}] for chunk in chunks]


def ideal_deviation(model, layers, input_ids, positions, meta, slots: torch.Tensor) -> list[float]:
    """The ``oracle`` arm's stand-in for recompute_selection.probe_deviation: every layer's K/V
    of the span computed exactly, each slot's change from the imported copy summed over the
    layers (relative to the layer's mean squared norm), the imported copy put back."""
    total = torch.zeros(slots.shape[0], device=slots.device)
    imported = [[cache.view(-1, *cache.shape[2:])[slots].clone() for cache in layer] for layer in layers]
    model.forward_layers(input_ids, positions, layers, meta, len(layers))
    for layer, copies in zip(layers, imported):
        for cache, copy in zip(layer, copies):
            flat = cache.view(-1, *cache.shape[2:])
            scale = copy.float().square().sum(dim=(1, 2)).mean()
            total += (flat[slots] - copy).float().square().sum(dim=(1, 2)) / scale
            flat[slots] = copy
    return total.tolist()


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probs [positions, vocab]."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def reference_runs(engine: dict, streams: list[Stream]) -> list[Reference]:
    """Full prefill on each stream: the greedy answers from a cold cache, then, cold again,
    the warm-up, the log-probs along the answers and the timed prompts."""
    arm = Arm(engine)
    references = []
    for stream in streams:
        arm.reset()
        answers = arm.greedy(stream.measured)
        arm.reset()
        arm.warm(stream.warmup)
        log_probs, _, computed = arm.forced(stream.measured, answers)
        references.append(Reference(answers, log_probs, computed, arm.ttft_ms(stream.timed)))
    arm.close()
    return references


def reuse_runs(engine: dict, spec: ArmSpec, streams: list[Stream], references: list[Reference],
               kl_only: bool) -> list[Figures]:
    """One chunk-reuse arm over every stream."""
    oracle = spec.strategy == "oracle"
    model_runner.probe_deviation = ideal_deviation if oracle else recompute_selection.probe_deviation
    arm = Arm(engine, enable_chunk_reuse=True, chunk_recompute_fraction=spec.fraction,
              chunk_recompute_strategy="deviation" if oracle else spec.strategy, chunk_recompute_window=spec.window)
    figures = []
    for stream, reference in zip(streams, references):
        arm.reset()
        arm.warm(stream.warmup)
        log_probs, imported, computed = arm.forced(stream.measured, reference.answers)
        reused = [i for i, tokens in enumerate(imported) if tokens]
        if not reused:
            raise ValueError(f"{stream.name}: no measured prompt reused a chunk (more --warmup)")
        if kl_only:
            first = [int(log_probs[i][0].argmax()) == reference.answers[i][0] for i in reused]
            short = exact = None
        else:
            tokens = arm.greedy([stream.measured[i] for i in reused])
            answers = [reference.answers[i] for i in reused]
            first = [t[0] == a[0] for t, a in zip(tokens, answers)]
            short = statistics.mean(t[:SHORT_ANSWER] == a[:SHORT_ANSWER] for t, a in zip(tokens, answers))
            exact = statistics.mean(t == a for t, a in zip(tokens, answers))
        divergence = statistics.mean(kl(reference.log_probs[i], log_probs[i]) for i in reused)
        figures.append(Figures(computed, len(reused), statistics.mean(first), short, exact, divergence,
                               arm.ttft_ms(stream.timed)))
        print(f"  {spec.name} on {stream.name}: {figures[-1]}", flush=True)
    arm.close()
    return figures


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def kl_text(value: float) -> str:
    """A mean KL, its rounding below 0 (an exact arm's) shown as 0."""
    return f"{max(value, 0.0):.4f}"


def stream_table(record: dict, index: int) -> str:
    """A stream's markdown table."""
    stream, reference = record["streams"][index], record["reference"][index]
    none_kl = record["arms"][NO_RECOMPUTE][index]["kl"] if NO_RECOMPUTE in record["arms"] else None
    lines = [f"**{stream['name']}** ({stream['measured']} measured prompts after {stream['warmup']} warm-up "
             "prompts)",
             "",
             f"| arm | prompt tokens computed | prompts importing a chunk | first-token agreement "
             f"| exact {SHORT_ANSWER} tokens | exact {ANSWER_TOKENS} tokens | mean KL, first {KL_POSITIONS} positions "
             "| KL vs no recompute | TTFT vs full prefill |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| full prefill (prefix caching) | {reference['computed']:.1%} | {stream['measured']} | 100% | 100% "
             f"| 100% | 0 | | 1.00x ({reference['ttft_ms']:.1f} ms) |"]
    for spec, figures in record["arms"].items():
        if index < len(figures):
            f = figures[index]
            lines.append(f"| {ArmSpec.parse(spec).name} | {f['computed']:.1%} | {f['reused']} | {f['first']:.1%} | "
                         f"{percent(f['exact_short'])} | {percent(f['exact'])} | {kl_text(f['kl'])} | "
                         f"{percent(none_kl and max(f['kl'], 0.0) / none_kl)} | "
                         f"{f['ttft_ms'] / reference['ttft_ms']:.2f}x |")
    return "\n".join(lines)


def range_table(record: dict) -> str:
    """Each arm's figures as min-max over the streams it ran on, its worst first-token agreement first."""
    def span(values, form):
        values = [v for v in values if v is not None]
        return f"{form(min(values))}-{form(max(values))}" if values else ""

    lines = ["| arm | streams | worst first-token agreement | first-token agreement "
             f"| exact {SHORT_ANSWER} tokens | exact {ANSWER_TOKENS} tokens "
             "| mean KL | prompt tokens computed | TTFT vs full prefill |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| full prefill (prefix caching) | {len(record['reference'])} | 100% | 100% | 100% | 100% | 0 | "
             f"{span([r['computed'] for r in record['reference']], '{:.1%}'.format)} | 1.00x |"]
    for spec, figures in record["arms"].items():
        column = lambda key: [f[key] for f in figures]  # noqa: E731
        ttft = [f["ttft_ms"] / r["ttft_ms"] for f, r in zip(figures, record["reference"])]
        lines.append(f"| {ArmSpec.parse(spec).name} | {len(figures)} | {min(column('first')):.1%} | "
                     f"{span(column('first'), '{:.1%}'.format)} | {span(column('exact_short'), '{:.1%}'.format)} | "
                     f"{span(column('exact'), '{:.1%}'.format)} | {span(column('kl'), kl_text)} | "
                     f"{span(column('computed'), '{:.1%}'.format)} | {span(ttft, '{:.2f}x'.format)} |")
    return "\n".join(lines)


def report(record: dict) -> None:
    print(f"\nThe embedded SmolLM2-135M-Instruct, float32, on {record['device']}; each pass one batched generate\n")
    for index in range(len(record["streams"])):
        print(stream_table(record, index) + "\n")
    print("Range over the streams:\n\n" + range_table(record))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", nargs="+", default=STREAMS, help="CORPUS:K:ORDER, e.g. pydoc:5:relevance")
    parser.add_argument("--streams-file", type=Path, help="the retrieval saved by --save-streams (else MiniLM runs)")
    parser.add_argument("--save-streams", type=Path, help="save both corpora's top-8 retrieval there and stop")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--timed", type=int, default=16, help="prompts after the measured ones, for TTFT")
    parser.add_argument("--arms", nargs="+", default=ARMS, type=lambda text: ArmSpec.parse(text) and text,
                        help="STRATEGY:FRACTION[:WINDOW], STRATEGY first, deviation or oracle")
    parser.add_argument("--kl-only", action="store_true",
                        help="skip the greedy answers (exact match); first-token agreement from the KL pass")
    parser.add_argument("--isolated", action="store_true",
                        help="warm up with every chunk of the measured prompts alone after the head")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV pool size")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no arm that would end past it")
    parser.add_argument("--json", type=Path, help="write every figure there (after each arm)")
    parser.add_argument("--report", type=Path, help="print the tables of a --json file and stop")
    return parser.parse_args()


def measure(args: argparse.Namespace) -> dict:
    """Every arm on every stream; the record (as report reads it) is rewritten to ``--json``
    after each arm, so that a run cut short keeps what it measured. No arm starts that would
    end past ``--budget-s`` (judged by the longest arm so far)."""
    started = time.monotonic()
    engine = {"dtype": "float32", "max_model_len": 4096, "kv_cache_memory_bytes": int(args.kv_gib * (1 << 30)),
              "enable_chunked_prefill": False, "max_num_batched_tokens": 32768, "max_num_seqs": 64}
    corpora = {name.split(":")[0] for name in args.streams}
    retrieved = (load_streams(args.streams_file) if args.streams_file else
                 {corpus: rag_stream(top_k=SAVED_TOP_K, corpus=corpus) for corpus in corpora})
    streams = build_streams(args.streams, retrieved, load_tokenizer(None), args)
    references = reference_runs(engine, streams)
    record = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
              "streams": [{"name": s.name, "warmup": len(s.warmup), "measured": len(s.measured)} for s in streams],
              "reference": [{"computed": r.computed, "ttft_ms": r.ttft_ms} for r in references], "arms": {}}
    longest = 0.0
    for text in [NO_RECOMPUTE] + [a for a in args.arms if a != NO_RECOMPUTE]:
        if time.monotonic() - started + longest > args.budget_s:
            print(f"  time budget spent: {text} and the arms after it not run", flush=True)
            break
        begin = time.monotonic()
        record["arms"][text] = [asdict(f) for f in reuse_runs(engine, ArmSpec.parse(text), streams, references,
                                                              args.kl_only)]
        longest = max(longest, time.monotonic() - begin)
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    args = parse_args()
    if args.save_streams:
        save_streams(args.save_streams, top_k=SAVED_TOP_K)
    elif args.report:
        report(json.loads(args.report.read_text()))
    else:
        report(measure(args))


if __name__ == "__main__":
    main()
