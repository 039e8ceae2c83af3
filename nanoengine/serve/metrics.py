"""Prometheus metrics for /metrics, under vLLM's names with a ``nanoengine:`` prefix.

Gauges and engine-wide counters come from each engine core's stats snapshot after each step;
per-request figures (tokens, TTFT, inter-token latency, end-to-end latency) from the outputs,
using the engine core's timestamps.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoengine.outputs import EngineStats, RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)


class Metrics:
    """Every metric is labelled with the model's name and the engine core's rank (``engine``), as in vLLM."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def metric(kind, name: str, doc: str, *extra_labels: str, **kwargs):
            return kind(f"nanoengine:{name}", doc, ["model_name", "engine", *extra_labels], registry=self.registry,
                        **kwargs)

        self.running = metric(Gauge, "num_requests_running", "Requests in the running queue")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests in the waiting queue")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = metric(Counter, "num_preemptions", "Preemptions")
        self.spec_drafts = metric(Counter, "spec_decode_num_drafts", "Drafts verified (one per request and step)")
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens")
        self.request_success = metric(Counter, "request_success", "Finished requests", "finished_reason")
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
        self.itl = metric(Histogram, "inter_token_latency_seconds", "Time between output tokens",
                          buckets=LATENCY_BUCKETS)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS)
        self.dropped_frames = Counter("nanoengine:engine_core_frames_dropped", "Frames the front dropped from its "
                                      "engine-core socket: undecodable, out of turn, or from a peer not admitted",
                                      ["model_name"], registry=self.registry)
        self.last_totals: dict[int, tuple] = {}  # per core: its cumulative counts (as in record_stats) seen so far

    def record_stats(self, engine: int, stats: EngineStats) -> None:
        labels = self.model_name, str(engine)
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions, stats.spec_num_drafts,
                  stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        counters = (self.prefix_queries, self.prefix_hits, self.preemptions, self.spec_drafts,
                    self.spec_draft_tokens, self.spec_accepted_tokens)
        for counter, new, old in zip(counters, totals, self.last_totals.get(engine, (0,) * len(totals))):
            counter.labels(*labels).inc(new - old)
        self.last_totals[engine] = totals

    def record_output(self, engine: int, output: RequestOutput, previous_token_time: float | None) -> None:
        """One DELTA output; ``previous_token_time`` is the last token time of the request's previous output."""
        labels = self.model_name, str(engine)
        metrics, num_new = output.metrics, len(output.outputs[0].token_ids)
        self.generation_tokens.labels(*labels).inc(num_new)
        if previous_token_time is None:
            self.prompt_tokens.labels(*labels).inc(len(output.prompt_token_ids))
            self.ttft.labels(*labels).observe(metrics.time_to_first_token)
        elif num_new:
            self.itl.labels(*labels).observe((metrics.last_token_time - previous_token_time) / num_new)
        if output.finished:
            self.e2e.labels(*labels).observe(metrics.finished_time - metrics.arrival_time)
            self.request_success.labels(*labels, output.outputs[0].finish_reason).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
