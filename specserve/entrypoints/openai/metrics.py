"""``/metrics``: Prometheus text with vLLM's metric names. Speculative decoding counters and the
running/waiting/KV-cache gauges are read from the engine at scrape time; token counters and the
latency histograms are updated by the engine thread as tokens are delivered (per token: ``k`` tokens
delivered together after ``dt`` count as ``k`` inter-token latencies of ``dt / k``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no ``*_created`` series beside each counter (as vLLM)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engine's counters when scraped."""

    def __init__(self, loop, model_name: str):
        self.loop, self.labels = loop, {"model_name": model_name}

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        m = self.loop.engine.metrics
        for name, doc, v in (("spec_decode_num_drafts", "Verification steps with at least one draft token.",
                              m.num_drafts),
                             ("spec_decode_num_draft_tokens", "Draft tokens verified.", m.num_draft_tokens),
                             ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m.num_accepted_tokens)):
            c = CounterMetricFamily("vllm:" + name, doc, labels=names)
            c.add_metric(values, v)
            yield c
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.", labels=names + ["position"])
        for i, v in enumerate(list(m.accepted_per_position)):
            per_pos.add_metric(values + [str(i)], v)
        yield per_pos
        running, waiting, usage = self.loop.counts()
        for name, doc, v in (("num_requests_running", "Sequences prefilling or decoding.", running),
                             ("num_requests_waiting", "Sequences waiting for a slot.", waiting),
                             ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", usage)):
            g = GaugeMetricFamily("vllm:" + name, doc, labels=names)
            g.add_metric(values, v)
            yield g


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started.", lab,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated and delivered.", lab,
                                         registry=self.registry)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       lab + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens, per token.", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def attach(self, loop) -> None:
        self.registry.register(_EngineCollector(loop, self.model_name))

    def tokens_delivered(self, r, n: int, now: float) -> None:
        m = self.model_name
        if r.last_token_time is None:
            self.prompt_tokens.labels(m).inc(len(r.prompt_ids))
            self.ttft.labels(m).observe(now - r.arrival)
            n_itl, since = n - 1, now  # tokens after the first in the same delivery: no wait of their own
        else:
            n_itl, since = n, r.last_token_time
        if n_itl > 0:
            per = (now - since) / n if r.last_token_time is not None else 0.0
            h = self.itl.labels(m)
            for _ in range(n_itl):
                h.observe(per)
        self.generation_tokens.labels(m).inc(n)

    def request_finished(self, r, reason: str | None, now: float) -> None:
        self.request_success.labels(self.model_name, reason or "unknown").inc()
        self.e2e.labels(self.model_name).observe(now - r.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
