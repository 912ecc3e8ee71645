"""`hybrid-engine inspect --verify-prefix`: the GDN state and logits after a prefix-cache hit,
compared with a full recompute of the same prompt.

Each engine (caching on, caching off) serves the first prompt to the end, then a second
request that continues it (first prompt + its output + the second prompt, as the next chat
turn would). With caching on the second request starts from the cache; its committed GDN
state and the log-probabilities of its first token after that prefill must match the engine
that computed everything.
"""

from __future__ import annotations

import argparse

from . import CLIError, build_llm, console, sampling_params, write_json


def prefix_report(engine) -> dict | None:
    """What the prefix cache holds and has served (None when caching is off)."""
    stats = engine.prefix_cache_stats
    if stats is None:
        return None
    u = engine.cache.usage()
    return {**stats, "blocks_cached_idle": u["blocks_cached_idle"], "checkpoints_total": u["checkpoints_total"],
            "checkpoint_bytes_total": u["checkpoint_bytes_total"]}


def verify_prefix(args, prompts_of) -> int:
    """prompts_of(llm) -> the prompts to use (the first two; text or token ids)."""
    from .. import SamplingParams

    k = args.speculative_tokens
    # --max-tokens and the other sampling flags, checked (and their defaults filled in) before
    # any model loads; the first turn is greedy past EOS so that both engines see the same history.
    first = sampling_params(args, temperature=0.0, ignore_eos=True)
    runs = {}
    for on in (False, True):
        llm = build_llm(argparse.Namespace(**{**vars(args), "enable_prefix_caching": on}), k, dtype=args.dtype or "float32")
        prompts = [llm.engine.encode_prompt(p)[1] for p in prompts_of(llm)]
        if len(prompts) < 2:
            prompts = [prompts[0], prompts[0][-4:]]
        engine = llm.engine
        engine.add_request(prompts[0], first, request_id="turn-1")
        output = []
        while engine.has_unfinished_requests():
            output = next((o.token_ids for o in engine.step() if o.finished), output)
        second = list(prompts[0]) + list(output) + list(prompts[1])
        engine.add_request(second, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=20),
                           request_id="turn-2")
        out = []
        while not out:                              # the step that ends turn 2's prefill
            out = [o for o in engine.step() if o.request_id == "turn-2"]
        rc = engine.cache.get("turn-2")
        held = engine.cache.pools
        states = {f"gdn{i}/{kind}": pool[rc.slot].detach().cpu().double()
                  for kind, pools in (("conv", held.conv_states), ("recurrent", held.recurrent_states))
                  for i, pool in enumerate(pools)}
        runs[on] = {"states": states, "logprobs": out[0].logprobs[0], "cached": out[0].num_cached_tokens,
                    "prompt_tokens": len(second), "prefix": prefix_report(engine)}
        while engine.has_unfinished_requests():
            engine.step()
        llm.shutdown()
    hit, ref = runs[True], runs[False]
    state_delta = max((hit["states"][key] - ref["states"][key]).abs().max().item() for key in ref["states"])
    shared = set(hit["logprobs"]) & set(ref["logprobs"])
    logprob_delta = max((abs(hit["logprobs"][t] - ref["logprobs"][t]) for t in shared), default=float("inf"))
    ok = hit["cached"] > 0 and state_delta <= args.atol and logprob_delta <= args.atol
    report = {"prompt_tokens": hit["prompt_tokens"], "cached_tokens": hit["cached"],
              "max_abs_state_delta": state_delta, "max_abs_logprob_delta": logprob_delta, "atol": args.atol,
              "ok": ok, "prefix_cache": hit["prefix"]}
    if args.json:
        write_json(args.json, report)
    if args.json != "-":
        out = console()
        out.print(f"turn 2: {hit['prompt_tokens']} prompt tokens, {hit['cached']} from the prefix cache")
        out.print(f"max |state delta| {state_delta:.3g}, max |logprob delta| {logprob_delta:.3g} (atol {args.atol})")
        out.print(f"prefix cache: {hit['prefix']}")
        out.print("[green]OK[/green]" if ok else "[red]MISMATCH[/red]" if hit["cached"] else
                  "[red]no hit: the history is shorter than one block[/red]")
    if hit["cached"] == 0 and hit["prompt_tokens"] > args.block_size:
        raise CLIError("the second turn did not hit the prefix cache")
    return 0 if ok else 1
