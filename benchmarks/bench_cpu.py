"""pagedrag vs HF transformers generate on CPU, and pagedrag's low-bit path vs its float32
path and llama.cpp, side by side in one run.

    python benchmarks/bench_cpu.py [--threads 2] [--repeats 3] [--tables hf lowbit] [--busy]

SmolLM2-135M-Instruct (the embedded default), the RAG workload of
pagedrag.entrypoints.bench (a fixed system prompt, 3-5 chunks from a pool of 16, a question;
600-800 prompt tokens). Prints markdown tables for benchmarks/RESULTS.md.

Table "hf": pagedrag float32 against HF generate. Table "lowbit": pagedrag on the GGUF's own
4-bit weights (quantization="gguf", the embedded model's CPU default) against pagedrag
float32 (quantization="none") and, when llama-cpp-python is installed, llama.cpp on the same
GGUF file (an optional comparison; built as benchmarks/RESULTS.md says). ``--busy`` keeps a
second process spinning on one core during the lowbit table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import time
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM

from pagedrag import LLM, SamplingParams
from pagedrag.entrypoints.bench import rag_requests
from pagedrag.models.embedded import embedded_gguf
from pagedrag.models.loader import cache_dir, resolve_checkpoint
from pagedrag.models.lowbit.linear import LowBitLinear

MAX_MODEL_LEN = 2048


def hf_generate_seconds(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def engine_ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return out.metrics.ttft


def bench_ttft(llm, hf, warmup, measured) -> dict:
    for prompt in warmup:  # first visit of each chunk set: fills the prefix cache
        engine_ttft(llm, prompt)
    hits_before = llm.stats()["prefix_cache_hits"]
    ours = [engine_ttft(llm, p) for p in measured]
    hit_tokens = llm.stats()["prefix_cache_hits"] - hits_before
    theirs = [hf_generate_seconds(hf, p, 1) for p in measured]
    return {"ours": statistics.median(ours), "hf": statistics.median(theirs),
            "hit": hit_tokens / sum(len(p) for p in measured)}


def bench_throughput(llm, hf, prompts, warmup, new_tokens, repeats) -> dict:
    """8 requests at once, with a warm prefix cache (it holds just the ``warmup`` prompts,
    which share their chunk sets) and with an empty one (cold), against HF generating
    them one at a time; the three alternate ``repeats`` times (this shared machine's
    speed drifts by tens of percent over minutes), and each figure is the median."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    tokens = len(prompts) * new_tokens
    seconds = {"warm": [], "cold": [], "hf": []}
    for _ in range(repeats):
        for name in ("warm", "cold"):
            llm.llm_engine.reset_prefix_cache()
            if name == "warm":
                for prompt in warmup:
                    engine_ttft(llm, prompt)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
        seconds["hf"].append(sum(hf_generate_seconds(hf, p, new_tokens) for p in prompts))
    return {name: tokens / statistics.median(values) for name, values in seconds.items()}


def bench_decode(llm, hf, prompt, new_tokens, repeats) -> dict:
    """Tokens a second after the first token, one request alone; ours and HF's alternate
    ``repeats`` times, each figure is the median."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours, theirs = [], []
    for _ in range(repeats):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ours.append((new_tokens - 1) / (out.metrics.finished_time - out.metrics.first_token_time))
        hf_decode = hf_generate_seconds(hf, prompt, new_tokens) - hf_generate_seconds(hf, prompt, 1)
        theirs.append((new_tokens - 1) / hf_decode)
    return {"ours": statistics.median(ours), "hf": statistics.median(theirs)}


def bench_memory(path, prompts, new_tokens, quantization: str | None = None) -> dict:
    """Real tokens in the KV pool / pool memory held, sampled every step (caching off,
    so each block belongs to one request), next to a contiguous max_model_len reservation."""
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=len(prompts), enable_prefix_caching=False,
              quantization=quantization)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    paged, contiguous = [], []
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        tokens = sum(r.num_computed_tokens for r in running)
        paged.append(tokens / (engine.kv.pool.num_used * engine.args.block_size))
        contiguous.append(tokens / (len(running) * MAX_MODEL_LEN))
    return {"paged": statistics.mean(paged), "contiguous": statistics.mean(contiguous)}


def engine_prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Time to the first token of ``prompt`` with an empty prefix cache (the whole prompt computed)."""
    llm.llm_engine.reset_prefix_cache()
    return engine_ttft(llm, prompt)


def engine_decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return (new_tokens - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


def engine_concurrent_rate(llm: LLM, prompts, warmup, new_tokens: int) -> float:
    """Generated tokens a second for ``prompts`` all at once, the prefix cache warmed with
    ``warmup`` (as bench_throughput's warm arm)."""
    llm.llm_engine.reset_prefix_cache()
    for prompt in warmup:
        engine_ttft(llm, prompt)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


class LlamaCpp:
    """llama-cpp-python on the embedded model's GGUF file, greedy, EOS masked out; with
    ``prompt_lookup`` tokens, llama.cpp's own prompt-lookup drafting (n-grams of up to 5 tokens,
    as pagedrag's ngram method is run in bench_spec_cpu.py)."""

    def __init__(self, threads: int, eos_token_id: int, prompt_lookup: int = 0):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=5, num_pred_tokens=prompt_lookup) if prompt_lookup else None
        self.model = Llama(model_path=str(embedded_gguf(cache_dir())), n_ctx=MAX_MODEL_LEN, n_threads=threads,
                           n_threads_batch=threads, draft_model=draft, logits_all=draft is not None,
                           verbose=False)
        self.eos_token_id = eos_token_id

    def prefill_seconds(self, prompt: list[int]) -> float:
        self.model.reset()  # no reuse of the previous prompt's KV
        start = time.perf_counter()
        self.model.eval(prompt)
        return time.perf_counter() - start

    def answer(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(decode tokens/s after the first token, the greedy answer's token ids)."""
        def no_eos(_, logits):
            logits[self.eos_token_id] = -float("inf")
            return logits

        self.model.reset()
        tokens, stamps = [], []
        for token in self.model.generate(prompt, temp=0.0, reset=True, logits_processor=[no_eos]):
            stamps.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        return self.answer(prompt, new_tokens)[0]


def llama_cpp_or_none(threads: int, eos_token_id: int) -> LlamaCpp | None:
    try:
        return LlamaCpp(threads, eos_token_id)
    except ImportError:
        print("llama-cpp-python is not installed: the llama.cpp column stays empty")
        return None


def _spin() -> None:
    while True:
        pass


@contextmanager
def one_core_busy(enabled: bool):
    """A second process spinning on one core while the block runs (when ``enabled``)."""
    burner = multiprocessing.Process(target=_spin, daemon=True) if enabled else None
    if burner:
        burner.start()
    try:
        yield
    finally:
        if burner:
            burner.terminate()
            burner.join()


def kernel_floor_rate(llm: LLM, repeats: int = 50) -> float:
    """Tokens a second that the low-bit products of one batch-1 decode step allow on their own:
    every LowBitLinear's low-bit layout (decoder projections and LM head) run back to back on
    one row, nothing else. No engine can decode faster on these kernels."""
    layouts = [module.layout for module in llm.llm_engine.runner.model.modules() if isinstance(module, LowBitLinear)]
    rows = {layout.in_features: torch.randn(1, layout.in_features) for layout in layouts}
    with torch.inference_mode():
        for layout in layouts:  # warm up
            layout(rows[layout.in_features])
        start = time.perf_counter()
        for _ in range(repeats):
            for layout in layouts:
                layout(rows[layout.in_features])
    return repeats / (time.perf_counter() - start)


def bench_lowbit(fp32: LLM, prompts, args) -> dict:
    """Low-bit vs float32 pagedrag (``fp32``) vs llama.cpp: each figure alternates the arms
    ``repeats`` times and keeps the median; the 8-request throughput is the low-bit engine's."""
    lowbit = LLM(None, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, quantization="gguf")
    llama = llama_cpp_or_none(args.threads, lowbit.llm_engine.tokenizer.eos_token_id)
    arms = {"lowbit": lowbit, "fp32": fp32}
    figures = {name: {"decode": [], "prefill": []} for name in (*arms, "llama.cpp")}
    figures["lowbit"]["concurrent"] = []
    figures["lowbit"]["kernel_floor"] = []
    for engine in arms.values():
        engine_ttft(engine, prompts[0])  # warm up
    with one_core_busy(args.busy):
        for _ in range(args.repeats):
            for name, engine in arms.items():
                figures[name]["decode"].append(engine_decode_rate(engine, prompts[0], 128))
                figures[name]["prefill"].append(len(prompts[1]) / engine_prefill_seconds(engine, prompts[1]))
            if llama is not None:
                figures["llama.cpp"]["decode"].append(llama.decode_rate(prompts[0], 128))
                figures["llama.cpp"]["prefill"].append(len(prompts[1]) / llama.prefill_seconds(prompts[1]))
            figures["lowbit"]["kernel_floor"].append(kernel_floor_rate(lowbit))
            figures["lowbit"]["concurrent"].append(engine_concurrent_rate(lowbit, prompts[16:24], prompts[:8],
                                                                          args.new_tokens))
    medians = {name: {k: statistics.median(v) for k, v in arm.items() if v} for name, arm in figures.items()}
    medians["lowbit"]["memory"] = bench_memory(None, prompts[16:24], args.new_tokens, "gguf")["paged"]
    medians["fp32"]["memory"] = bench_memory(None, prompts[16:24], args.new_tokens, "none")["paged"]
    return medians


def print_lowbit_table(m: dict, prompt_len: int, args) -> None:
    llama = m["llama.cpp"]
    versus = lambda key: f"{m['lowbit'][key] / llama[key]:.2f}x" if key in llama else "n/a"
    shown = lambda arm, key: f"{m[arm][key]:.1f} tok/s" if key in m[arm] else "n/a"
    concurrency = m["lowbit"]["concurrent"] / m["lowbit"]["decode"]
    versus_floor = f"{m['lowbit']['kernel_floor'] / llama['decode']:.2f}x" if "decode" in llama else "n/a"
    print(f"\nlow-bit (quantization='gguf') vs float32 vs llama.cpp, {args.threads} threads"
          f"{', one core busy' if args.busy else ''}\n")
    print("| figure | pagedrag low-bit | pagedrag fp32 | llama.cpp | low-bit vs llama.cpp | target |")
    print("|---|---|---|---|---|---|")
    print(f"| batch-1 decode, 128 tokens | {shown('lowbit', 'decode')} | {shown('fp32', 'decode')} | "
          f"{shown('llama.cpp', 'decode')} | {versus('decode')} | >= 0.9x llama.cpp |")
    print(f"| prefill, {prompt_len}-token prompt, cold cache | {shown('lowbit', 'prefill')} | "
          f"{shown('fp32', 'prefill')} | {shown('llama.cpp', 'prefill')} | {versus('prefill')} | "
          f">= fp32 ({m['lowbit']['prefill'] / m['fp32']['prefill']:.2f}x) |")
    print(f"| batch-1 decode bound of the int4 kernel alone (every low-bit product of one token, nothing "
          f"else) | {shown('lowbit', 'kernel_floor')} | | | {versus_floor} | |")
    print(f"| 8 concurrent x {args.new_tokens} tokens, warm prefix cache | {shown('lowbit', 'concurrent')} | | | | "
          f">= 2.5x batch-1 decode ({concurrency:.1f}x) |")
    print(f"| KV memory holding real tokens / reserved | {m['lowbit']['memory']:.1%} | {m['fp32']['memory']:.1%} "
          f"| | | unchanged |")


def print_hf_table(llm: LLM, path: str, prompts, args) -> None:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine_ttft(llm, prompts[0]), hf_generate_seconds(hf, prompts[0], 1)  # warm both up
    llm.llm_engine.reset_prefix_cache()
    ttft = bench_ttft(llm, hf, prompts[:8], prompts[8:16])
    throughput = bench_throughput(llm, hf, prompts[16:24], prompts[:8], args.new_tokens, args.repeats)
    decode = bench_decode(llm, hf, prompts[0], 128, args.repeats)
    memory = bench_memory(path, prompts[16:24], args.new_tokens)

    print("| figure | pagedrag | HF generate | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| median TTFT, warm prefix cache (hit {ttft['hit']:.0%} of prompt tokens) | "
          f"{ttft['ours'] * 1000:.0f} ms | {ttft['hf'] * 1000:.0f} ms | {ttft['hf'] / ttft['ours']:.1f}x lower | >= 5x |")
    for name in ("warm", "cold"):
        print(f"| throughput, 8 concurrent requests x {args.new_tokens} tokens ({name} prefix cache) vs HF one at a time | "
              f"{throughput[name]:.1f} tok/s | {throughput['hf']:.1f} tok/s | {throughput[name] / throughput['hf']:.1f}x | >= 4x |")
    print(f"| batch-1 decode, 128 tokens | {decode['ours']:.1f} tok/s | {decode['hf']:.1f} tok/s | "
          f"{decode['ours'] / decode['hf']:.2f}x | >= 1.0x |")
    print(f"| KV memory holding real tokens / reserved | {memory['paged']:.1%} (paged, block 16) | "
          f"{memory['contiguous']:.1%} (contiguous max_model_len={MAX_MODEL_LEN}) | | >= 96% |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs behind each median")
    parser.add_argument("--tables", nargs="+", choices=("hf", "lowbit"), default=["hf", "lowbit"])
    parser.add_argument("--busy", action="store_true", help="a second process spins on one core (lowbit table)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_checkpoint(None))
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, quantization="none")
    requests = rag_requests(24, num_chunk_sets=8, tokenizer=llm.get_tokenizer())
    prompts = [llm.apply_chat_template(r.messages())["prompt_token_ids"] for r in requests]
    lengths = [len(p) for p in prompts]
    print(f"\nSmolLM2-135M-Instruct, {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; prompts {min(lengths)}-{max(lengths)} tokens\n")
    if "hf" in args.tables:
        print_hf_table(llm, path, prompts, args)
    if "lowbit" in args.tables:
        print_lowbit_table(bench_lowbit(llm, prompts, args), len(prompts[1]), args)


if __name__ == "__main__":
    main()
