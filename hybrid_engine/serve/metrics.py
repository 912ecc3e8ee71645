"""Prometheus metrics under vLLM's names (`vllm:...`), so existing dashboards read them.

Request counters and latency histograms are observed by the server as outputs reach it;
the engine gauges (running / waiting requests, cache usage) are read from the engine on its
own loop thread at each scrape. One registry per server, so two apps in one process (the
tests) never share counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets, in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class EngineGauges:
    """What a scrape reads from the engine (on its loop thread)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float      # fraction of KV blocks in use
    state_slot_usage: float    # fraction of GDN state slots in use (draft slots included)
    num_preemptions: int
    prefix_cache: dict | None = None   # LLMEngine.prefix_cache_stats (None: caching off)


def read_engine_gauges(engine) -> EngineGauges:
    usage = engine.cache.usage()
    return EngineGauges(
        num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
        kv_cache_usage=usage["blocks_used"] / max(usage["blocks_total"], 1),
        state_slot_usage=usage["slots_used"] / max(usage["slots_total"], 1),
        num_preemptions=engine.num_preemptions, prefix_cache=engine.prefix_cache_stats)


class ServerMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self._running = Gauge("vllm:num_requests_running", "Requests in the running batch.", label, registry=r)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", label, registry=r)
        self._kv = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                         label, registry=r)
        self._slots = Gauge("vllm:state_slot_usage_perc",
                            "Fraction of GDN recurrent-state slots in use, draft slots included (1 = full).",
                            label, registry=r)
        self._preemptions = Gauge("vllm:num_preemptions", "Preemptions since the engine started.",
                                  label, registry=r)
        # vLLM's prefix-cache counters count tokens: queried (prompt tokens looked up) and hit.
        self._prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                       label, registry=r)
        self._prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                    label, registry=r)
        self._checkpoints = Gauge("hybrid_engine:prefix_cache_checkpoints", "GDN state checkpoints held.",
                                  label, registry=r)
        self._prefix_seen = (0, 0)     # the engine's cumulative (queried, hit) tokens at the last scrape
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=r)
        self.request_success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                       label + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.", label,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output deltas, per token.",
                             label, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             label, buckets=_E2E_BUCKETS, registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps (drafts proposed).",
                                   label, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                         label, registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     label, registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.",
                                             label + ["position"], registry=r)
        for m in (self.prompt_tokens, self.generation_tokens, self.spec_drafts, self.spec_draft_tokens,
                  self.spec_accepted):
            m.labels(model_name)   # present (at 0) from the start
        for pos in range(num_speculative_tokens):
            self.spec_accepted_per_pos.labels(model_name, str(pos))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        per_token = seconds / max(num_tokens, 1)
        child = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            child.observe(per_token)

    def observe_finished(self, output, e2e_seconds: float, count_prompt: bool) -> None:
        """One finished request (a choice); its prompt is counted once per HTTP request."""
        name = self.model_name
        if count_prompt:
            self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(len(output.token_ids))
        self.request_success.labels(name, output.finish_reason or "abort").inc()
        self.e2e.labels(name).observe(e2e_seconds)
        spec = (output.metrics or {}).get("spec_decode")
        if spec:
            self.spec_drafts.labels(name).inc(spec["num_verify_steps"])
            self.spec_draft_tokens.labels(name).inc(spec["num_drafted"])
            self.spec_accepted.labels(name).inc(spec["num_accepted"])
            steps = spec["num_verify_steps"]
            for pos, rate in enumerate(spec["acceptance_rate_per_position"]):
                self.spec_accepted_per_pos.labels(name, str(pos)).inc(round(rate * steps))

    def render(self, gauges: EngineGauges | None) -> bytes:
        if gauges is not None:
            name = self.model_name
            self._running.labels(name).set(gauges.num_running)
            self._waiting.labels(name).set(gauges.num_waiting)
            self._kv.labels(name).set(gauges.kv_cache_usage)
            self._slots.labels(name).set(gauges.state_slot_usage)
            self._preemptions.labels(name).set(gauges.num_preemptions)
            if gauges.prefix_cache is not None:
                self._observe_prefix_cache(gauges.prefix_cache)
        return generate_latest(self.registry)

    def _observe_prefix_cache(self, stats: dict) -> None:
        name, (queried, hit) = self.model_name, self._prefix_seen
        self._prefix_queries.labels(name).inc(stats["query_tokens"] - queried)
        self._prefix_hits.labels(name).inc(stats["hit_tokens"] - hit)
        self._prefix_seen = (stats["query_tokens"], stats["hit_tokens"])
        self._checkpoints.labels(name).set(stats["checkpoints_held"])
