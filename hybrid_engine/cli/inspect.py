"""`hybrid-engine inspect`: the cache as the engine sees it, step by step.

Three modes: show pools, requests and per-layer state statistics at a step (or every step),
optionally saving a snapshot; `--verify-rewind`, which steps a speculative and a plain engine
side by side and compares their committed state at equal token counts; and `inspect diff`,
which compares two snapshots.
"""

from __future__ import annotations

import math
import os
import sys

from . import (CLIError, add_engine_arguments, add_prompt_arguments, add_sampling_arguments, build_llm,
                  check_output_path, console, dtype_name, encode_prompts, read_prompts, sampling_params,
                  write_json)
from .inspect_prefix import prefix_report, verify_prefix

NAME = "inspect"
HELP = "inspect pools, block tables, slots and per-layer state; snapshots and their diff"
DESCRIPTION = """\
Runs generation to --step N (or prints every step with --each-step) and shows pool occupancy,
each request's block table, state slot, draft slots, KV length and spec stats, and per-layer
statistics of its GDN conv / recurrent state and of the K / V of its used positions.
Without prompts, two built-in code prompts are used (token ids when the model has no tokenizer).

  hybrid-engine inspect --step 3 --speculative-tokens 2 --snapshot a.safetensors
  hybrid-engine inspect diff a.safetensors b.safetensors --atol 1e-6
  hybrid-engine inspect --verify-rewind --speculative-tokens 3 --max-tokens 32
"""
DIFF_DESCRIPTION = ("Compare two snapshots written by `inspect --snapshot`: names the first layer (and "
                    "request) whose state differs beyond the tolerance; exit code 1 when they differ.")

DEFAULT_STEP = 4
DEFAULT_VERIFY_K = 2


def add_arguments(parser) -> None:
    add_prompt_arguments(parser)
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help=f"engine steps to run before showing the state (default: {DEFAULT_STEP}; "
                             "with --each-step: until every request finishes)")
    parser.add_argument("--each-step", action="store_true", help="show the state after every step")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help=f"MTP speculation with K drafts (default: off; {DEFAULT_VERIFY_K} for --verify-rewind)")
    parser.add_argument("--snapshot", default=None, metavar="FILE",
                        help="save every live request's per-layer state (safetensors) at the last step shown")
    parser.add_argument("--verify-rewind", action="store_true",
                        help="compare the committed state of speculative and plain greedy runs after every step")
    parser.add_argument("--verify-prefix", action="store_true",
                        help="compare the state and logits after a prefix-cache hit with a full recompute")
    parser.add_argument("--atol", type=float, default=1e-5,
                        help="tolerance for --verify-rewind / --verify-prefix (default: 1e-5)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON ('-' = stdout)")
    add_sampling_arguments(parser, max_tokens=16, full=False)
    add_engine_arguments(parser, dtype_default=None,
                         dtype_help="weight dtype (default: auto; float32 for --verify-rewind, "
                                    "which its 1e-5 tolerance assumes)")


def add_diff_arguments(parser) -> None:
    parser.add_argument("a", metavar="A", help="snapshot file")
    parser.add_argument("b", metavar="B", help="snapshot file")
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default: 1e-5)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default: 0)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the comparison as JSON ('-' = stdout)")


def run(args) -> int:
    if args.atol < 0:
        raise CLIError(f"--atol must be >= 0, got {args.atol}")
    if args.step is not None and args.step < 1:
        raise CLIError(f"--step must be >= 1, got {args.step}")
    check_output_path("--json", args.json, stdout_ok=True)
    check_output_path("--snapshot", args.snapshot)
    if args.verify_prefix:
        return verify_prefix(args, lambda llm: encode_prompts(
            llm, read_prompts(args, stdin_fallback=False)[0] or _default_prompts(llm)))
    return _verify_rewind(args) if args.verify_rewind else _inspect(args)


# ---- layers and state --------------------------------------------------------------------------

def layer_names(engine, with_mtp: bool) -> tuple[list[str], list[str]]:
    """Names of the GDN pools and of the KV pools (model layer index; the MTP layer last)."""
    cfg = engine.model_config
    gdn = [f"layers.{i}" for i in cfg.linear_attention_layers]
    attn = [f"layers.{i}" for i in cfg.full_attention_layers]
    if with_mtp and engine.model.mtp is not None:
        attn.append("mtp")
    return gdn, attn


def layer_depth(name: str) -> float:
    """Sort key: "layers.{i}" by i, the MTP layer after them all."""
    return math.inf if name == "mtp" else int(name.split(".")[1])


def capture_live(engine, with_mtp: bool = True) -> dict[str, dict]:
    """request id -> its committed state, for every request holding cache memory. The MTP
    layer's KV is included only when the engine drafts (otherwise nothing writes it)."""
    from hybrid_engine.state_cache.snapshot import capture_request

    gdn, attn = layer_names(engine, with_mtp=with_mtp and engine.drafter is not None)
    return {rid: capture_request(engine.cache, rid, req.num_computed_tokens, gdn, attn)
            for rid, req in engine.requests.items()
            if rid in engine.cache and req.num_computed_tokens > 0}


def tensor_stats(t) -> dict:
    import torch

    t = t.double()
    finite = t[torch.isfinite(t)]
    return {"shape": list(t.shape), "norm": finite.norm().item(),
            "min": finite.min().item() if finite.numel() else None,
            "max": finite.max().item() if finite.numel() else None,
            "nan": int(t.isnan().sum()), "inf": int(t.isinf().sum())}


# ---- inspect at a step -------------------------------------------------------------------------

def _default_prompts(llm) -> list:
    from .bench import BUILTIN_PROMPTS

    if llm.tokenizer is not None:
        return BUILTIN_PROMPTS[:2]
    vocab = llm.engine.model_config.vocab_size
    return [[t % vocab for t in range(1, 12)], [t % vocab for t in range(20, 27)]]


def _start(args, k: int, dtype: str | None = None):
    llm = build_llm(args, k, dtype=dtype or args.dtype or "auto")
    prompts = encode_prompts(llm, read_prompts(args, stdin_fallback=False)[0] or _default_prompts(llm))
    return llm, prompts


def _inspect(args) -> int:
    params = sampling_params(args)
    llm, prompts = _start(args, args.speculative_tokens)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    last_step = args.step or (None if args.each_step else DEFAULT_STEP)
    out = console()
    reports, finished, snapshot, step = [], {}, None, 0
    while engine.has_unfinished_requests() and (last_step is None or step < last_step):
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
        step += 1
        if args.each_step or step == last_step or not engine.has_unfinished_requests():
            states = capture_live(engine)
            reports.append(_step_report(engine, step, finished, states))
            if args.json != "-":
                _print_step(out, reports[-1], engine)
            if states:
                snapshot = (step, states, [_snapshot_entry(engine.requests[rid]) for rid in states])
    if args.snapshot:
        _save_snapshot(args.snapshot, engine, snapshot, step)
    if args.json:
        write_json(args.json, {"model": engine.config.model, "dtype": dtype_name(engine),
                               "num_speculative_tokens": engine.num_speculative_tokens, "steps": reports})
    return 0


def _step_report(engine, step: int, finished: dict, states: dict) -> dict:
    layers = []
    for rid, tensors in states.items():
        for key in sorted(tensors, key=lambda key: layer_depth(key.rpartition("/")[0])):
            layer, _, tensor = key.rpartition("/")
            layers.append({"request": rid, "layer": layer, "tensor": tensor, **tensor_stats(tensors[key])})
    return {"step": step, "finished": dict(finished), "pools": _pools(engine), "ranks": _ranks(engine),
            "prefix_cache": prefix_report(engine),
            "requests": [_request_row(engine, rid, req) for rid, req in engine.requests.items()],
            "layers": layers}


def _pools(engine) -> dict:
    from hybrid_engine.state_cache import CheckpointPool

    cache, spec = engine.cache, engine.cache.spec
    u = cache.usage()
    held = [cache.get(rid) for rid in engine.requests if rid in cache]
    conv_slot = spec.num_gdn_layers * math.prod(spec.conv_slot_shape) * spec.conv_dtype.itemsize
    rec_slot = spec.num_gdn_layers * math.prod(spec.recurrent_slot_shape) * spec.state_dtype.itemsize
    checkpoints_held = u["checkpoints_published"] + u["checkpoints_pending"]
    ckpt_bytes = CheckpointPool.bytes_per_checkpoint(spec)
    return {
        "kv_blocks": {"total": u["blocks_total"], "used": u["blocks_used"], "free": u["blocks_free"],
                      "block_size": spec.block_size, "attention_layers": spec.num_attention_layers,
                      "bytes_per_block": spec.bytes_per_block},
        "state_slots": {"total": u["slots_total"], "used": u["slots_used"], "free": u["slots_free"],
                        "committed": len(held), "draft": sum(len(rc.draft_slots) for rc in held),
                        "draft_slots_per_request": engine.num_speculative_tokens,
                        "bytes_per_slot": spec.bytes_per_slot},
        # Prefix caching's GDN checkpoints (none when it is off): held ones are published or
        # still owned by a running request (pending).
        "checkpoints": {"total": u["checkpoints_total"], "used": checkpoints_held,
                        "free": u["checkpoints_total"] - checkpoints_held, "bytes_per_checkpoint": ckpt_bytes},
        "bytes": {kind: {"total": total, "used": used} for kind, total, used in (
            ("kv", u["kv_bytes_total"], u["kv_bytes_used"]),
            ("conv", u["slots_total"] * conv_slot, u["slots_used"] * conv_slot),
            ("recurrent", u["slots_total"] * rec_slot, u["slots_used"] * rec_slot),
            ("checkpoints", u["checkpoint_bytes_total"], checkpoints_held * ckpt_bytes))},
    }


def _ranks(engine) -> list[dict]:
    """The tensor-parallel ranks (one without it): each holds a cache of the same geometry for
    its own heads, so every rank's share is the pools' bytes above (the driver's)."""
    group, spec, u = engine.tp_group, engine.cache.spec, engine.cache.usage()
    workers = group.workers if group is not None else []
    cfg = engine.model_config
    size = group.size if group is not None else 1
    rows = []
    for rank in range(size):
        process = (None if group is not None and group.launch is not None else
                   workers[rank - 1].pid if rank else os.getpid())
        rows.append({"rank": rank, "pid": process, "role": "driver" if rank == 0 else "worker",
                     "attention_heads": max(cfg.num_attention_heads // size, 1),
                     "kv_heads": max(cfg.num_key_value_heads // size, 1),
                     "gdn_value_heads": max(cfg.linear_num_value_heads // size, 1),
                     "cache_bytes": u["kv_bytes_total"] + u["slots_total"] * spec.bytes_per_slot
                     + u["checkpoint_bytes_total"]})
    return rows


def _request_row(engine, rid: str, req) -> dict:
    rc = engine.cache.get(rid) if rid in engine.cache else None
    return {"id": rid, "status": req.status.value, "prompt_tokens": len(req.prompt_token_ids),
            "output_tokens": len(req.output_token_ids), "kv_len": req.num_computed_tokens,
            "kv_reserved": rc.num_tokens if rc else 0, "block_table": list(rc.block_table) if rc else [],
            "slot": rc.slot if rc else None, "draft_slots": list(rc.draft_slots) if rc else [],
            "draft_tokens": list(req.draft_token_ids),
            "spec": req.spec_stats.as_dict() if req.spec_stats is not None else None}


def _print_step(out, report: dict, engine) -> None:
    k = engine.num_speculative_tokens
    done = ", ".join(f"{rid} ({why})" for rid, why in report["finished"].items()) or "none"
    out.print(f"\n[bold]step {report['step']}[/bold]  |  {engine.config.model}  |  "
              f"{'MTP k=' + str(k) if k else 'no speculation'}  |  finished: {done}")
    out.print(_pools_table(report["pools"]))
    if len(report["ranks"]) > 1:
        out.print(_ranks_table(report["ranks"]))
    if report["prefix_cache"] is not None:
        p = report["prefix_cache"]
        out.print(f"prefix cache: {p['blocks_cached']} cached blocks ({p['blocks_cached_idle']} idle), "
                  f"{p['checkpoints_held']} of {p['checkpoints_total']} checkpoints at lengths "
                  f"{p['checkpoint_lengths']} ({p['checkpoints_pending']} pending); {p['queries']} queries, "
                  f"{p['hits']} hits, {p['hit_tokens']} hit tokens ({100 * p['hit_rate']:.0f}%)")
    if not report["requests"]:
        out.print("no live requests")
        return
    out.print(_requests_table(report["requests"], k))
    out.print(_layers_table(report["layers"]))


def _table(title: str, columns: list[str], left: tuple[str, ...]):
    from rich.table import Table

    table = Table(title=title)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right")
    return table


def _pools_table(p: dict):
    kv, slots, b = p["kv_blocks"], p["state_slots"], p["bytes"]
    table = _table("pools", ["pool", "total", "used", "free", "bytes / unit", "bytes used / total"], ("pool",))
    table.add_row(f"KV blocks ({kv['block_size']} tokens x {kv['attention_layers']} attention layers)",
                  str(kv["total"]), str(kv["used"]), str(kv["free"]), _bytes(kv["bytes_per_block"]),
                  f"{_bytes(b['kv']['used'])} / {_bytes(b['kv']['total'])}")
    table.add_row(f"state slots ({slots['committed']} committed + {slots['draft']} draft)",
                  str(slots["total"]), str(slots["used"]), str(slots["free"]), _bytes(slots["bytes_per_slot"]),
                  f"{_bytes(b['conv']['used'] + b['recurrent']['used'])} / "
                  f"{_bytes(b['conv']['total'] + b['recurrent']['total'])}")
    for kind in ("conv", "recurrent"):
        table.add_row(f"  of which {kind} state", "", "", "", "",
                      f"{_bytes(b[kind]['used'])} / {_bytes(b[kind]['total'])}")
    ck = p["checkpoints"]
    if ck["total"]:
        table.add_row("prefix checkpoints (GDN state + hidden)", str(ck["total"]), str(ck["used"]), str(ck["free"]),
                      _bytes(ck["bytes_per_checkpoint"]),
                      f"{_bytes(b['checkpoints']['used'])} / {_bytes(b['checkpoints']['total'])}")
    return table


def _ranks_table(ranks: list[dict]):
    table = _table("tensor-parallel ranks (the pools and the layer statistics are rank 0's heads; every rank's "
                   "cache has their geometry)", ["rank", "role", "pid", "attention heads", "KV heads",
                                                  "GDN value heads", "cache bytes"], ("role",))
    for r in ranks:
        table.add_row(str(r["rank"]), r["role"], str(r["pid"] or "torchrun"), str(r["attention_heads"]),
                      str(r["kv_heads"]), str(r["gdn_value_heads"]), _bytes(r["cache_bytes"]))
    return table


def _requests_table(requests: list[dict], k: int):
    table = _table("requests", ["id", "status", "prompt", "output", "KV len", "reserved", "block table", "slot",
                                "draft slots", "verifies", "accepted / drafted", "mean accept len"],
                   ("status", "block table", "draft slots"))
    for r in requests:
        s = r["spec"]
        table.add_row(r["id"], r["status"], str(r["prompt_tokens"]), str(r["output_tokens"]), str(r["kv_len"]),
                      str(r["kv_reserved"]), str(r["block_table"]), "-" if r["slot"] is None else str(r["slot"]),
                      str(r["draft_slots"]) if k else "-", str(s["num_verify_steps"]) if s else "-",
                      f"{s['num_accepted']} / {s['num_drafted']}" if s else "-",
                      f"{s['mean_accept_length']:.2f}" if s else "-")
    return table


def _layers_table(rows: list[dict]):
    table = _table("per-layer state (committed slot; K / V over the used positions)",
                   ["req", "layer", "tensor", "shape", "norm", "min", "max", "NaN", "Inf"],
                   ("layer", "tensor", "shape"))
    for row in rows:
        style = "[red]" if row["nan"] or row["inf"] else ""
        table.add_row(row["request"], row["layer"], row["tensor"], "x".join(map(str, row["shape"])),
                      _num(row["norm"]), _num(row["min"]), _num(row["max"]),
                      f"{style}{row['nan']}", f"{style}{row['inf']}")
    return table


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _snapshot_entry(req) -> dict:
    return {"id": req.request_id, "num_tokens": req.num_computed_tokens,
            "prompt_tokens": len(req.prompt_token_ids), "output_tokens": len(req.output_token_ids)}


def _save_snapshot(path: str, engine, snapshot, step: int) -> None:
    from hybrid_engine.state_cache.snapshot import Snapshot, save_snapshot

    if snapshot is None:
        raise CLIError(f"nothing to snapshot: every request finished by step {step}; "
                       "use a smaller --step or a larger --max-tokens")
    at, states, requests = snapshot
    cfg = engine.model_config
    layers = [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp"]
    metadata = {"model": engine.config.model, "step": at, "dtype": dtype_name(engine),
                "num_speculative_tokens": engine.num_speculative_tokens, "layers": layers, "requests": requests}
    save_snapshot(path, Snapshot(metadata, states))
    print(f"snapshot of {len(states)} request(s) at step {at} written to {path}", file=sys.stderr)


# ---- --verify-rewind ---------------------------------------------------------------------------

def _verify_rewind(args) -> int:
    # Greedy, past EOS: both runs then emit the same tokens for max_tokens steps.
    params = sampling_params(args, temperature=0.0, ignore_eos=True)
    k = args.speculative_tokens or DEFAULT_VERIFY_K
    # The tolerance is meant for float32; other dtypes only when asked for.
    spec_llm, prompts = _start(args, k, dtype=args.dtype or "float32")
    ref_llm = build_llm(args, 0, dtype=args.dtype or "float32")
    spec, ref = spec_llm.engine, ref_llm.engine
    for i, p in enumerate(prompts):
        spec.add_request(p, params, request_id=str(i))
        ref.add_request(p, params, request_id=str(i))
    gdn, attn = layer_names(ref, with_mtp=False)
    layers = sorted(gdn + attn, key=layer_depth)
    ref_states: dict[tuple[str, int], dict] = {}
    steps, outputs = [], {"spec": {}, "ref": {}}
    step = 0
    while spec.has_unfinished_requests():
        verifies = {rid: (r.spec_stats.num_verify_steps, r.spec_stats.num_accepted) for rid, r in spec.requests.items()}
        _collect(spec.step(), outputs["spec"])
        step += 1
        row = {"step": step, "requests": {}, "max_abs_delta": {name: 0.0 for name in layers}}
        for rid, got in capture_live(spec, with_mtp=False).items():
            n = spec.requests[rid].num_computed_tokens
            want = _ref_state_at(ref, rid, n, ref_states, outputs["ref"])
            if want is None:
                continue
            stats = spec.requests[rid].spec_stats
            before = verifies.get(rid, (0, 0))
            verified = stats.num_verify_steps > before[0]
            row["requests"][rid] = {"num_tokens": n, "phase": "verify" if verified else "prefill",
                                    "accepted": stats.num_accepted - before[1] if verified else None}
            for key, t in got.items():
                layer = key.rpartition("/")[0]
                row["max_abs_delta"][layer] = _worse(row["max_abs_delta"][layer], _max_abs_delta(t, want[key]))
        if row["requests"]:
            steps.append(row)
    while ref.has_unfinished_requests():
        _collect(ref.step(), outputs["ref"])
    return _rewind_report(args, spec, k, layers, steps, outputs)


def _max_abs_delta(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _worse(a: float, b: float) -> float:
    """The larger delta; NaN (a NaN or Inf in either state) beats everything."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _collect(step_outputs, into: dict) -> None:
    for o in step_outputs:
        if o.finished:
            into[o.request_id] = o.token_ids


def _ref_state_at(ref, rid: str, n: int, store: dict, outputs: dict):
    """The plain engine's committed state of request `rid` at n tokens, stepping it as far as
    needed; states it passes on the way are kept for the other requests."""
    while (rid, n) not in store:
        req = ref.requests.get(rid)
        if req is None or req.num_computed_tokens > n:
            return None      # a count the plain run never stops at (a prefill chunk boundary)
        _collect(ref.step(), outputs)
        for other, state in capture_live(ref).items():
            store[(other, ref.requests[other].num_computed_tokens)] = state
    state = store.pop((rid, n))
    for key in [key for key in store if key[0] == rid and key[1] < n]:
        del store[key]       # the speculative run only moves forward
    return state


def _rewind_report(args, spec, k: int, layers: list[str], steps: list[dict], outputs: dict) -> int:
    worst = {name: (0.0, None) for name in layers}       # layer -> (max |delta|, at step)
    for row in steps:
        for name, d in row["max_abs_delta"].items():
            so_far = worst[name][0]
            if not math.isnan(so_far) and (math.isnan(d) or d > so_far):   # the first NaN stays
                worst[name] = (d, row["step"])
    num_verified = sum(r["phase"] == "verify" for row in steps for r in row["requests"].values())
    report = {"model": spec.config.model, "dtype": dtype_name(spec), "num_speculative_tokens": k,
              "atol": args.atol, "num_requests": len(outputs["ref"]), "num_verify_comparisons": num_verified,
              "greedy_outputs_identical": outputs["spec"] == outputs["ref"],
              "max_abs_delta": {name: d for name, (d, _) in worst.items()}, "steps": steps,
              "passed": num_verified > 0 and all(d <= args.atol for d, _ in worst.values())}
    if args.json:
        write_json(args.json, report)
    if args.json != "-":
        _print_rewind(report, worst, set(layer_names(spec, with_mtp=False)[0]))
    return 0 if report["passed"] else 1


def _print_rewind(report: dict, worst: dict, gdn_layers: set[str]) -> None:
    out, atol = console(), report["atol"]
    per_step = _table(f"committed state, MTP k={report['num_speculative_tokens']} vs no speculation, "
                      "at equal token counts", ["step", "request: tokens, phase (accepted)", "max |delta|",
                                                "worst layer"], ("request: tokens, phase (accepted)", "worst layer"))
    for row in report["steps"]:
        layer, d = _worst_layer(row["max_abs_delta"])
        reqs = "  ".join(f"{rid}: {r['num_tokens']}, {r['phase']}"
                         + (f" ({r['accepted']})" if r["accepted"] is not None else "")
                         for rid, r in row["requests"].items())
        per_step.add_row(str(row["step"]), reqs, f"{d:.2e}", layer)
    out.print(per_step)
    per_layer = _table("per layer, over all steps", ["layer", "type", "state compared", "max |delta|", "at step"],
                       ("layer", "type", "state compared"))
    for name, (d, at) in worst.items():
        kind = ("GDN", "conv + recurrent") if name in gdn_layers else ("attention", "K + V of committed tokens")
        per_layer.add_row(name, *kind, f"{'' if d <= atol else '[red]'}{d:.2e}", "-" if at is None else str(at))
    out.print(per_layer)
    out.print(f"greedy outputs identical: {'yes' if report['greedy_outputs_identical'] else 'NO'}")
    _, overall = _worst_layer(report["max_abs_delta"])
    n = report["num_verify_comparisons"]
    why = ("no verify step was compared; raise --max-tokens" if n == 0 else
           f"max |delta| {overall:.2e} {'<=' if report['passed'] else '>'} {atol:g} over {n} verify comparisons "
           f"({report['num_requests']} requests)")
    out.print(f"{'PASS' if report['passed'] else 'FAIL'}: {why}")


def _worst_layer(deltas: dict[str, float]) -> tuple[str, float]:
    """(layer, delta) of the largest delta, a NaN first; ("-", 0.0) when all are 0."""
    worst = ("-", 0.0)
    for layer, d in deltas.items():
        if math.isnan(d):
            return layer, d
        if d > worst[1]:
            worst = (layer, d)
    return worst


# ---- inspect diff ------------------------------------------------------------------------------

def run_diff(args) -> int:
    from hybrid_engine.state_cache.snapshot import diff_snapshots, load_snapshot

    if args.atol < 0 or args.rtol < 0:
        raise CLIError(f"--atol and --rtol must be >= 0, got {args.atol} and {args.rtol}")
    check_output_path("--json", args.json, stdout_ok=True)
    a, b = load_snapshot(args.a), load_snapshot(args.b)
    d = diff_snapshots(a, b, atol=args.atol, rtol=args.rtol)
    if args.json:
        write_json(args.json, {
            "a": args.a, "b": args.b, "atol": args.atol, "rtol": args.rtol, "equal": d.equal,
            "problems": d.problems, "first": vars(d.first) if d.first else None,
            "entries": [vars(e) for e in d.entries]})
    if args.json != "-":
        _print_diff(args, a, b, d)
    return 0 if d.equal else 1


def _print_diff(args, a, b, d, max_rows: int = 30) -> None:
    out = console()
    for label, path, snap in (("A", args.a, a), ("B", args.b, b)):
        m = snap.metadata
        out.print(f"{label}: {path}  (model {m.get('model')}, step {m.get('step')}, {len(m['requests'])} requests)")
    for problem in d.problems:
        out.print(f"[red]{problem}[/red]")
    if d.equal:
        out.print(f"snapshots match: {len(d.entries)} tensors within atol={args.atol:g}, rtol={args.rtol:g}")
    first = d.first
    if first is None:
        return
    out.print(f"first difference: layer {first.layer}, request {first.request}, {first.kind}: "
              + (first.note or f"max |delta| {first.max_abs:.3e}"))
    differing = [e for e in d.entries if e.differs]
    table = _table(f"{len(differing)} of {len(d.entries)} tensors differ",
                   ["layer", "request", "tensor", "max |delta|"], ("layer", "request", "tensor"))
    for e in differing[:max_rows]:
        table.add_row(e.layer, e.request, e.kind, e.note or f"{e.max_abs:.3e}")
    out.print(table)
    if len(differing) > max_rows:
        out.print(f"... and {len(differing) - max_rows} more (see --json)")
