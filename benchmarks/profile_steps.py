"""Where an engine step's time goes on a GPU: per-step wall time split into the model
runner (input prep + forward + logits) and the rest (scheduling, sampling, bookkeeping),
for the RAG workload of bench_gpu.py.

    python benchmarks/profile_steps.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict

import torch

from bench_gpu import NEW_TOKENS, llama3_8b_config, rag_prompts
from pagedrag import LLM, SamplingParams


def instrument(engine) -> list[dict]:
    """Wrap engine.step and runner.execute to record each step's timings."""
    records: list[dict] = []
    step, execute = engine.step, engine.runner.execute

    def timed_execute(sched, tables):
        start = time.perf_counter()
        logits = execute(sched, tables)
        torch.cuda.synchronize()
        records[-1]["runner"] = time.perf_counter() - start
        records[-1]["tokens"] = sched.num_tokens
        records[-1]["decode"] = all(s.num_new_tokens == 1 for s in sched.scheduled)
        records[-1]["batch"] = len(sched.scheduled)
        return logits

    def timed_step():
        records.append({})
        start = time.perf_counter()
        out = step()
        records[-1]["step"] = time.perf_counter() - start
        return out

    engine.step, engine.runner.execute = timed_step, timed_execute
    return records


def summarize(records: list[dict]) -> None:
    groups = defaultdict(list)
    for r in records:
        groups["decode" if r.get("decode") else "prefill/mixed"].append(r)
    for name, rows in groups.items():
        steps = [r["step"] for r in rows]
        runner = [r.get("runner", 0) for r in rows]
        print(f"{name}: {len(rows)} steps, {sum(steps):.3f} s total; step median {statistics.median(steps) * 1e3:.2f} ms, "
              f"runner median {statistics.median(runner) * 1e3:.2f} ms; tokens/step median "
              f"{statistics.median(r.get('tokens', 0) for r in rows)}; batch median {statistics.median(r.get('batch', 0) for r in rows)}")


def main() -> None:
    config = llama3_8b_config()
    prompts = rag_prompts()
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    records = instrument(llm.llm_engine)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print(f"RAG workload: {time.perf_counter() - start:.3f} s")
    summarize(records)
    records.clear()
    llm.generate({"prompt_token_ids": prompts[5]}, params, use_tqdm=False)
    print("batch 1:")
    summarize(records)


if __name__ == "__main__":
    main()
