"""Beam search over the engine, as vLLM's LLM.beam_search does it.

Each round every live beam is sent as a one-token request asking for its top
2 * beam_width logprobs; the best beam_width extensions of each prompt live on.
The beams of a prompt share their KV blocks through the prefix cache: a round
recomputes at most the partial last block of each beam, never the shared prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedrag.engine.llm_engine import LLMEngine
from pagedrag.outputs import RequestOutput
from pagedrag.sampling_params import BeamSearchParams, SamplingParams

# Runs prompts to completion (LLM.generate without a progress bar).
Generate = Callable[[list, SamplingParams], list[RequestOutput]]


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and output
    cum_logprob: float = 0.0
    text: str | None = None
    finished: bool = False


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(seq: BeamSearchSequence, num_prompt_tokens: int, length_penalty: float,
               eos_token_ids: set[int]) -> float:
    """Cumulative logprob normalized by output length ** length_penalty (EOS not counted)."""
    length = len(seq.tokens) - num_prompt_tokens
    if seq.tokens and seq.tokens[-1] in eos_token_ids:
        length -= 1
    return seq.cum_logprob / max(length, 1) ** length_penalty


def _round(generate: Generate, live: list[list[BeamSearchSequence]], salts: list[str | None],
           params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
    """One token for every live beam; returns each prompt's candidate extensions."""
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature,
                                 logprobs=2 * params.beam_width, ignore_eos=True)
    flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
    prompts = [{"prompt_token_ids": beam.tokens, **({"cache_salt": salts[i]} if salts[i] else {})}
               for i, beam in flat]
    outputs = generate(prompts, step_params)
    candidates: list[list[BeamSearchSequence]] = [[] for _ in live]
    for (i, beam), output in zip(flat, outputs):
        for token, logprob in output.outputs[0].logprobs[0].items():
            candidates[i].append(BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob.logprob))
    return candidates


def run_beam_search(engine: LLMEngine, generate: Generate, prompts: list,
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
    eos = set() if params.ignore_eos else engine.eos_token_ids
    processed = [engine.inputs.process(p) for p in prompts]
    prompt_lens = [len(p.token_ids) for p in processed]
    salts = [p.cache_salt for p in processed]
    live = [[BeamSearchSequence(list(p.token_ids))] for p in processed]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        if not any(live):
            break
        candidates = _round(generate, live, salts, params)
        for i, options in enumerate(candidates):
            score = lambda s, i=i: beam_score(s, prompt_lens[i], params.length_penalty, eos)  # noqa: E731
            options.sort(key=score, reverse=True)
            finished = [s for s in options[:params.beam_width] if s.tokens[-1] in eos]
            for s in finished:
                s.finished = True
            done[i].extend(finished)
            kept = [s for s in options if s.tokens[-1] not in eos][:params.beam_width]
            live[i] = [s for s in kept if len(s.tokens) < engine.max_model_len]  # room for one more token
            done[i].extend(s for s in kept if len(s.tokens) >= engine.max_model_len)
    results = []
    for i in range(len(prompts)):
        pool = done[i] + live[i]
        pool.sort(key=lambda s, i=i: beam_score(s, prompt_lens[i], params.length_penalty, eos), reverse=True)
        best = pool[:params.beam_width]
        for s in best:
            s.text = engine.tokenizer.decode(s.tokens[prompt_lens[i]:], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
