"""A small engine workload with staggered arrivals (batch sizes change from step to step), for
tests that compare two ways of running the same steps."""

from __future__ import annotations

import random

from hybrid_engine import SamplingParams


def staggered_workload(seed: int = 0, logprobs: int | None = None):
    """-> (prompts, params, arrival step of each request): five greedy requests and one seeded
    sampled one (the last)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 20), ignore_eos=True, logprobs=logprobs)
              for _ in range(5)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True,
                                 logprobs=logprobs))
    arrivals = [0, 0, 1, 3, 3, 9]
    return prompts, params, arrivals


def run_staggered(engine, prompts, params, arrivals) -> list:
    """Adds request i at step arrivals[i] and steps until all finish -> the final RequestOutputs in
    order. `params`: one SamplingParams per request, or one for all."""
    if not isinstance(params, (list, tuple)):
        params = [params] * len(prompts)
    outs, step = {}, 0
    while len(outs) < len(prompts):
        for i, t in enumerate(arrivals):
            if t == step:
                engine.add_request(prompts[i], params[i], request_id=str(i))
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id)] = o
        step += 1
    return [outs[i] for i in range(len(prompts))]
