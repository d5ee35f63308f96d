"""Where an engine step's time goes on a GPU: wall time per step next to the time the
device spends in kernels, for a batch-1 decode and the RAG workload of bench_gpu.py.

    python benchmarks/profile_steps.py

A step whose device time is close to its wall time is device-bound; a gap is host
work (scheduling, input preparation, sampling bookkeeping) that the device waits for.
The top kernels by device time are printed for the batch-1 decode.
"""

from __future__ import annotations

import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_gpu import NEW_TOKENS, llama3_8b_config, rag_prompts
from pagedrag import LLM, SamplingParams


def profiled(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, int, object]:
    """(wall s, device s, engine steps, profile) of generating new_tokens for each prompt."""
    engine = llm.llm_engine
    steps = 0
    step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.step = step
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == DeviceType.CUDA) / 1e6
    return wall, kernels, steps, prof


def main() -> None:
    config = llama3_8b_config()
    prompts = rag_prompts()
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in rag_prompts(seed=1)], params, use_tqdm=False)  # compile
    cached = prompts[0][:1280] + prompts[2][-32:]
    cases = [("batch-1 decode", prompts[5:6], NEW_TOKENS), ("RAG workload", prompts, NEW_TOKENS),
             ("TTFT, 1,280 of 1,312 tokens cached", [cached], 1)]
    for name, batch, new_tokens in cases:
        llm.llm_engine.reset_prefix_cache()
        if new_tokens == 1:
            llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1), use_tqdm=False)
        wall, kernels, steps, prof = profiled(llm, batch, new_tokens)
        print(f"{name}: {steps} steps, wall {wall * 1e3:.1f} ms ({wall / steps * 1e3:.2f} ms a step), "
              f"kernels {kernels * 1e3:.1f} ms ({kernels / wall:.0%} of wall)")
        if name != "RAG workload":
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


if __name__ == "__main__":
    main()
