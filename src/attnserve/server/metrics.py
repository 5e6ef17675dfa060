"""Prometheus metrics of one server, in a registry of its own.

Every `ServerMetrics` owns a fresh ``prometheus_client.CollectorRegistry`` (nothing is
registered in the library's global default registry), so several apps or tests in one
process never share or collide on metrics. The engine loop thread feeds it; ``GET
/metrics`` renders it with `ServerMetrics.render`.

Exported (prefix ``attnserve_``; seconds for times, tokens for counts):

=====================================  =========  ==============================================
name                                   type       meaning
=====================================  =========  ==============================================
num_running_reqs                       gauge      requests in the running batch
num_waiting_reqs                       gauge      requests in the waiting queue
kv_slots_used / kv_slots_total         gauge      KV-cache token slots in use / in the pool
kv_cache_bytes{kv_cache_dtype}         gauge      bytes of the KV pool (all layers) and its storage dtype
prompt_tokens_total                    counter    prompt tokens of accepted requests
generation_tokens_total                counter    generated tokens
requests_total{finish_reason}          counter    finished requests (stop, length, abort, error)
requests_rejected_total{status}        counter    requests refused by the engine (400, 503)
retractions_total                      counter    times decode ran out of KV pages and retracted
retracted_requests_total               counter    requests sent back to the queue by retractions
new_token_ratio                        gauge      admission estimate of future output per request
cached_prompt_tokens_total             counter    prompt tokens served from the prefix cache
prefix_cache_hit_rate                  gauge      cached / admitted prompt tokens since start
kv_slots_evictable / kv_slots_protected gauge     cached tokens no request holds / held by requests
spec_verify_total                      counter    speculative verifies (one per request and step)
spec_accept_length                     gauge      mean tokens per verify since start (SGLang's accept length)
time_to_first_token_seconds            histogram  arrival -> first generated token
inter_token_latency_seconds            histogram  gap between consecutive tokens of a request
e2e_request_latency_seconds            histogram  arrival -> last token
=====================================  =========  ==============================================

The same facts also go out under SGLang's names (prefix ``sglang:``, label ``model_name``),
so dashboards built for SGLang work unchanged (`SGLangNames`): gauges
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``,
``sglang:token_usage`` (used / total KV slots), ``sglang:gen_throughput`` (generated tokens
per second over the last second or more), ``sglang:cache_hit_rate``,
``sglang:spec_accept_length``; counters ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``, ``sglang:cached_tokens_total``,
``sglang:num_requests_total``, ``sglang:num_aborted_requests_total``; histograms
``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
``sglang:e2e_request_latency_seconds``. A colon is legal in Prometheus metric names (not in
label names; rule-recording convention); prometheus-client accepts it in the metric's name
as given (a ``namespace`` would join with ``_``, so the prefix is part of the name). Source
(names and meanings, facts only): SGLang's "Production Metrics" documentation.
"""

from __future__ import annotations

import time
from typing import Any, Dict

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The metrics of one server (thread-safe: prometheus-client metrics lock internally).

    Args:
        model_name: value of the ``model_name`` label on every metric.
    """

    def __init__(self, model_name: str = "default"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        kw = dict(registry=self.registry, namespace="attnserve")

        def gauge(name, doc):
            return Gauge(name, doc, labels, **kw).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, **kw).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, **kw).labels(model_name)

        self.running = gauge("num_running_reqs", "Requests in the running batch.")
        self.waiting = gauge("num_waiting_reqs", "Requests in the waiting queue.")
        self.kv_used = gauge("kv_slots_used", "KV-cache token slots in use.")
        self.kv_total = gauge("kv_slots_total", "KV-cache token slots in the pool.")
        self._kv_bytes = Gauge("kv_cache_bytes", "Bytes of the KV pool (all layers).",
                               labels + ["kv_cache_dtype"], **kw)
        self._model_name = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token (s).",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens (s).",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token (s).", _E2E_BUCKETS)
        self._finished = Counter("requests", "Finished requests by finish reason.", labels + ["finish_reason"], **kw)
        self._rejected = Counter("requests_rejected", "Requests refused by the engine, by HTTP status.",
                                 labels + ["status"], **kw)
        self.retractions = counter("retractions", "Times decode ran out of KV pages and retracted requests.")
        self.retracted = counter("retracted_requests", "Requests sent back to the waiting queue by retractions.")
        self.new_token_ratio = gauge("new_token_ratio", "Admission estimate of future output per request.")
        self.cached_prompt_tokens = counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache.")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Cached / admitted prompt tokens since start.")
        self.kv_evictable = gauge("kv_slots_evictable", "Cached KV tokens no running request holds.")
        self.kv_protected = gauge("kv_slots_protected", "Cached KV tokens held by running requests.")
        self.spec_verify = counter("spec_verify", "Speculative verifies (one per request and step).")
        self.spec_accept_length = gauge("spec_accept_length", "Mean tokens per speculative verify since start.")
        self._seen = {"retractions": 0, "retracted_requests": 0, "cached_prompt_tokens": 0, "spec_verify": 0}
        self.model_name = model_name
        self.sglang = SGLangNames(self.registry, model_name)

    # ---- fed by the engine loop thread ---------------------------------------------------------
    def on_accept(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.sglang.prompt_tokens.inc(prompt_tokens)

    def on_reject(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.sglang.ttft.observe(ttft_s)

    def on_inter_token(self, gap_s: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens arrived ``gap_s`` seconds after the previous one: each is
        observed at ``gap_s / num_tokens``."""
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)
            self.sglang.itl.observe(gap_s / num_tokens)

    def on_generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)
        self.sglang.on_generated(num_tokens)

    def on_finish(self, finish_reason: str, e2e_s: float) -> None:
        self._finished.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e_s)
        self.sglang.on_finish(finish_reason, e2e_s)

    def set_state(self, state: Dict[str, Any]) -> None:
        """Update the gauges from an `EngineLoop` state snapshot."""
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        self.kv_used.set(state["kv_slots_used"])
        self.kv_total.set(state["kv_slots_total"])
        if "kv_cache_bytes" in state:
            self._kv_bytes.labels(self._model_name, state["kv_cache_dtype"]).set(state["kv_cache_bytes"])
        for key, metric in (("retractions", self.retractions), ("retracted_requests", self.retracted),
                            ("cached_prompt_tokens", self.cached_prompt_tokens), ("spec_verify", self.spec_verify)):
            value = state.get(key, 0)
            if value > self._seen[key]:  # the snapshot holds totals; the counter takes increments
                metric.inc(value - self._seen[key])
                self._seen[key] = value
        if "spec_accept_length" in state:
            self.spec_accept_length.set(state["spec_accept_length"])
        if "new_token_ratio" in state:
            self.new_token_ratio.set(state["new_token_ratio"])
        if state.get("admitted_prompt_tokens"):
            self.hit_rate.set(state.get("cached_prompt_tokens", 0) / state["admitted_prompt_tokens"])
        self.kv_evictable.set(state.get("kv_slots_cached", 0))
        self.kv_protected.set(state.get("kv_slots_protected", 0))
        self.sglang.set_state(state)

    # ---- read by HTTP handlers -----------------------------------------------------------------
    def render(self) -> bytes:
        """Prometheus text exposition format (media type `content_type`)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    @staticmethod
    def content_type() -> str:
        from prometheus_client import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST


class SGLangNames:
    """The metrics under SGLang's ``sglang:`` names, in ``registry`` (fed by `ServerMetrics`).

    Args:
        registry: the server's ``CollectorRegistry``.
        model_name: value of the ``model_name`` label.
        throughput_window_s: ``sglang:gen_throughput`` is refreshed when at least this many
            seconds passed since its last refresh (tokens generated in between / elapsed).
    """

    def __init__(self, registry, model_name: str, throughput_window_s: float = 1.0):
        from prometheus_client import Counter, Gauge, Histogram

        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"sglang:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name, doc):
            return Counter(f"sglang:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"sglang:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.num_running_reqs = gauge("num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("num_used_tokens", "The number of KV-cache tokens in use.")
        self.token_usage = gauge("token_usage", "KV-cache tokens in use / KV-cache tokens in the pool.")
        self.gen_throughput = gauge("gen_throughput", "The generation throughput (tokens/s).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / admitted.")
        self.spec_accept_length = gauge("spec_accept_length", "Mean tokens per speculative verify.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of prompt tokens served from the prefix cache.")
        self.num_requests = counter("num_requests", "Number of finished requests.")
        self.num_aborted_requests = counter("num_aborted_requests", "Number of aborted requests.")
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                             _E2E_BUCKETS)
        self.window_s = throughput_window_s
        self._generated = 0
        self._window_start = (time.monotonic(), 0)
        self._cached_seen = 0

    def on_generated(self, num_tokens: int) -> None:
        self._generated += num_tokens
        self.generation_tokens.inc(num_tokens)

    def on_finish(self, finish_reason: str, e2e_s: float) -> None:
        self.num_requests.inc()
        if finish_reason == "abort":
            self.num_aborted_requests.inc()
        self.e2e.observe(e2e_s)

    def set_state(self, state: Dict[str, Any]) -> None:
        """Gauges from an engine-loop state snapshot; the throughput window rolls here."""
        self.num_running_reqs.set(state["running"])
        self.num_queue_reqs.set(state["waiting"])
        self.num_used_tokens.set(state["kv_slots_used"])
        if state["kv_slots_total"]:
            self.token_usage.set(state["kv_slots_used"] / state["kv_slots_total"])
        if state.get("admitted_prompt_tokens"):
            self.cache_hit_rate.set(state.get("cached_prompt_tokens", 0) / state["admitted_prompt_tokens"])
        cached = state.get("cached_prompt_tokens", 0)
        if cached > self._cached_seen:  # the snapshot holds a total; the counter takes increments
            self.cached_tokens.inc(cached - self._cached_seen)
            self._cached_seen = cached
        if "spec_accept_length" in state:
            self.spec_accept_length.set(state["spec_accept_length"])
        now = time.monotonic()
        t0, n0 = self._window_start
        if now - t0 >= self.window_s:
            self.gen_throughput.set((self._generated - n0) / (now - t0))
            self._window_start = (now, self._generated)
