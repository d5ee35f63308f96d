"""Speculative decoding on CPU: batch-1 greedy decode speed of the embedded model with and
without drafting from the context, side by side in one run.

    nice -n 10 python benchmarks/bench_spec_cpu.py [--prompts 5] [--max-tokens 128] [--quantization gguf]
    nice -n 10 python benchmarks/bench_spec_cpu.py --concurrency 1 2 4 8 [--max-tokens 64] [--workload "pydoc stream"]
    nice -n 10 python benchmarks/bench_spec_cpu.py --pipelined   # adds "ngram pipelined"

Four workloads: "rag", the RAG prompts of pagedrag.entrypoints.bench (a system prompt, 3-5
standard-library docstring chunks, a question about one of them; 600-800 tokens), whose
answers copy their chunks; "pydoc stream" and "stdlib stream", questions spread evenly over
the 176-question pydoc-topics stream and over the same stream built on the standard library's
docstrings (benchmarks/rag_stream.py: MiniLM top-5 chunks, the canonicalizer's layout); and
"open", short open-ended prompts that copy nothing. Each
prompt is answered greedily by an engine without speculation, with ``ngram`` and with
``suffix`` (engines built once, prompts interleaved so that drift hits all alike; the first
prompt of each workload warms up and is not counted). Decode speed is a request's output
tokens after the first over the time from its first token to its end; "tokens a step" is those
tokens over the decode steps that made them (drafting or not), "mean acceptance length" the
same over drafting steps only (vLLM's figure). Prints markdown
tables for benchmarks/RESULTS.md, with each engine's agreement with the one without
speculation: the share of answer tokens before the first that differs (1.00 in float32; the
low-bit kernels round a 9-row product differently from a 1-row one, so near-ties can flip).

With ``--quantization gguf`` llama.cpp (llama-cpp-python) decodes the same GGUF file beside
them, interleaved the same way: alone, and with its own prompt-lookup drafting (n-grams of up
to 5 tokens, 8 drafted), the comparison issue 27 asks for. Its agreement column compares with
pagedrag's answer without speculation (other kernels: near-ties may go the other way).

``--pipelined`` adds an ``ngram`` engine with asynchronous scheduling, which drafts and verifies
greedy requests on the device, each step launched before the previous one is read
(engine.pipelined_drafting; off by default on CPU).

``--concurrency``: where drafting stops paying (``disable_by_batch_size``). For each
concurrency N, N prompts of ``--workload`` (default "rag") go into one ``generate`` on each engine (drafting forced on at
every batch size), twice with new prompts each time, engines interleaved; the figures are the
better pass's output tokens over wall time (prefill included) and its decode rate (tokens
after each request's first, over the time from the batch's first first token to its last
finish).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import time

from bench_cpu import LlamaCpp
from pagedrag import LLM, SamplingParams
from pagedrag.entrypoints.bench import rag_requests

CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}
OPEN_PROMPTS = ("Write a short poem about the sea.", "Tell me a story about a robot who learns to paint.",
                "Describe your ideal weekend.", "What would you do with a million dollars?",
                "Invent a new board game and explain its rules.", "Write a letter to your future self.")


def decode_rate(output) -> float:
    times = output.metrics
    return (len(output.outputs[0].token_ids) - 1) / (times.finished_time - times.first_token_time)


def workloads(tokenizer, num_prompts: int, streams: bool = False) -> dict[str, list[str]]:
    """The prompts of each workload (``num_prompts`` + 1 each: the first warms up); the two
    streams only with ``streams``."""
    def chat(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rag = [chat(r.messages()) for r in rag_requests(num_prompts + 1, num_chunk_sets=num_prompts + 1,
                                                    tokenizer=tokenizer)]
    open_ended = [chat([{"role": "user", "content": text}]) for text in OPEN_PROMPTS[:num_prompts + 1]]
    from_streams = {f"{corpus} stream": [chat(messages) for messages in stream_prompts(corpus, num_prompts + 1)]
                    for corpus in ("pydoc", "stdlib")} if streams else {}
    return {"rag": rag, **from_streams, "open": open_ended}


def stream_prompts(corpus: str, count: int) -> list[list[dict]]:
    """Chat messages of ``count`` questions spread evenly over a rag_stream corpus's stream."""
    from rag_stream import SYSTEM_PROMPT, rag_stream

    from pagedrag.rag.canonical import PromptCanonicalizer

    stream = rag_stream(corpus=corpus)
    canonicalizer = PromptCanonicalizer(SYSTEM_PROMPT)
    return [canonicalizer.build(question, [(chunk.source_id, chunk.text) for chunk in chunks]).messages
            for question, chunks in stream[::max(1, len(stream) // count)][:count]]


def run(engines: dict[str, LLM], llama_cpps: dict[str, LlamaCpp], prompts: list[str],
        params: SamplingParams) -> tuple[dict, dict, dict]:
    """Decode rates by engine (prompts after the first), their tokens a decode step and mean
    acceptance lengths (None for llama.cpp), and their agreement with the engine without
    speculation."""
    names = [*engines, *llama_cpps]
    rates, answers = {name: [] for name in names}, {name: [] for name in names}
    before = {name: llm.stats() for name, llm in engines.items()}
    tokenizer = engines["off"].get_tokenizer()
    for index, prompt in enumerate(prompts):
        for name, llm in engines.items():
            output = llm.generate(prompt, params, use_tqdm=False)[0]
            rate, answers[name] = decode_rate(output), answers[name] + [output.outputs[0].token_ids]
            rates[name] += [rate] if index else []
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        for name, llama in llama_cpps.items():
            rate, answer = llama.answer(prompt_ids, params.max_tokens)
            rates[name] += [rate] if index else []
            answers[name].append(answer)
    tokens = sum(len(answer) - 1 for answer in answers["off"])
    acceptance = {name: _acceptance(before[name], llm.stats(), tokens) for name, llm in engines.items()}
    acceptance.update(dict.fromkeys(llama_cpps))
    return rates, acceptance, {name: _agreement(answers[name], answers["off"]) for name in names}


def _agreement(answers: list[list[int]], references: list[list[int]]) -> float:
    """The share of reference tokens before the first that differs, over all answers."""
    agreed = 0
    for answer, reference in zip(answers, references):
        agreed += next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), len(reference))
    return agreed / sum(len(reference) for reference in references)


def _acceptance(before: dict, after: dict, tokens: int) -> tuple[float, float] | None:
    """(tokens a decode step, mean acceptance length) of an engine that decoded ``tokens``
    tokens after the first ones of its answers; None without drafting."""
    if "spec_decode_num_drafts" not in after:
        return None
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return tokens / (tokens - accepted), (1 + accepted / drafts if drafts else 0.0)


def concurrency_sweep(levels: list[int], max_tokens: int, quantization: str | None, workload: str) -> None:
    """Output tokens/s of N requests of ``workload`` at once, with and without drafting, for each N."""
    always = {name: None if config is None else {**config, "disable_by_batch_size": max(levels)}
              for name, config in CONFIGS.items()}
    engines = {name: LLM(speculative_config=config, quantization=quantization, max_model_len=2048,
                         kv_cache_memory_bytes=512 << 20) for name, config in always.items()}
    # Each pass its own prompts: suffix's global index would otherwise replay the last pass's answers.
    prompts = workloads(engines["off"].get_tokenizer(), 2 * sum(levels), streams=workload != "rag")[workload]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    unused = iter(prompts[1:])
    drafting = [name for name in engines if name != "off"]
    print("| concurrent requests | " + " | ".join(f"{name} tok/s, wall / decode" for name in engines) + " | "
          + " | ".join(f"{name} vs off, wall / decode" for name in drafting) + " |")
    print("|---" * (1 + len(engines) + len(drafting)) + "|")
    for level in levels:
        rates = {name: [] for name in engines}
        for _ in range(2):
            batch = [next(unused) for _ in range(level)]
            for name, llm in engines.items():
                started = time.perf_counter()
                outputs = llm.generate(batch, params, use_tqdm=False)
                wall = time.perf_counter() - started
                rates[name].append((sum(len(o.outputs[0].token_ids) for o in outputs) / wall, batch_decode_rate(outputs)))
        best = {name: tuple(max(rate[i] for rate in values) for i in (0, 1)) for name, values in rates.items()}
        print(f"| {level} | " + " | ".join(f"{best[name][0]:.1f} / {best[name][1]:.1f}" for name in engines) + " | "
              + " | ".join(f"{best[name][0] / best['off'][0]:.2f}x / {best[name][1] / best['off'][1]:.2f}x"
                           for name in drafting) + " |")


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python is there to decode beside pagedrag (it is built from source: a
    bench without it says so and runs pagedrag's arms alone)."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return True
    print("llama.cpp rows left out: llama-cpp-python is not installed (pip install llama-cpp-python)\n")
    return False


def batch_decode_rate(outputs) -> float:
    """Tokens after each request's first over the time from the batch's first first token to its
    last finish: the decode phase of requests run at once (the prompts' prefill left out)."""
    start = min(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", help="sweep these numbers of concurrent requests")
    parser.add_argument("--workload", default="rag", choices=("rag", "pydoc stream", "stdlib stream"),
                        help="the prompts of the concurrency sweep")
    parser.add_argument("--pipelined", action="store_true", help='add "ngram pipelined" (asynchronous scheduling)')
    args = parser.parse_args()
    if args.concurrency:
        concurrency_sweep(args.concurrency, args.max_tokens, args.quantization, args.workload)
        return
    configs = {name: (config, False) for name, config in CONFIGS.items()}
    if args.pipelined:
        configs["ngram pipelined"] = (CONFIGS["ngram"], True)
    engines = {name: LLM(speculative_config=config, async_scheduling=pipelined, quantization=args.quantization,
                         max_model_len=2048, kv_cache_memory_bytes=256 << 20)
               for name, (config, pipelined) in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    eos = engines["off"].get_tokenizer().eos_token_id
    threads = os.cpu_count() or 1
    llama_cpps = {} if args.quantization != "gguf" or not llama_cpp_installed() else {
        "llama.cpp": LlamaCpp(threads, eos), "llama.cpp prompt lookup": LlamaCpp(threads, eos, prompt_lookup=8)}
    print(f"{platform.machine()}, quantization={args.quantization}, {args.prompts} prompts a workload, "
          f"{args.max_tokens} tokens\n")
    print("| workload | drafting | decode tok/s (median) | per prompt | vs off | tokens a step | "
          "mean acceptance length | agreement with off |")
    print("|---|---|---|---|---|---|---|---|")
    for workload, prompts in workloads(engines["off"].get_tokenizer(), args.prompts, streams=True).items():
        rates, acceptance, agreement = run(engines, llama_cpps, prompts, params)
        baseline = statistics.median(rates["off"])
        for name in rates:
            median = statistics.median(rates[name])
            per_step, length = ("-", "-") if acceptance[name] is None else (f"{a:.2f}" for a in acceptance[name])
            print(f"| {workload} | {name} | {median:.1f} | {', '.join(f'{r:.1f}' for r in rates[name])} | "
                  f"{median / baseline:.2f}x | {per_step} | {length} | {agreement[name]:.2f} |")


if __name__ == "__main__":
    main()
