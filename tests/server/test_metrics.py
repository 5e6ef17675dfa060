"""Prometheus metrics: per-app registries and live values from the real server."""

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from attnserve.server.metrics import ServerMetrics


def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            out[key] = s.value
    return out


def test_registries_are_per_instance():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.on_accept(5)
    a.on_first_token(0.1)
    sa, sb = _samples(a.render().decode()), _samples(b.render().decode())
    assert sa["attnserve_prompt_tokens_total"] == 5 and sb["attnserve_prompt_tokens_total"] == 0
    assert sa["attnserve_time_to_first_token_seconds_count"] == 1
    assert sb["attnserve_time_to_first_token_seconds_count"] == 0
    assert REGISTRY.get_sample_value("attnserve_prompt_tokens_total", {"model_name": "a"}) is None


def test_retractions_counted_from_engine_totals():
    m = ServerMetrics("r")
    base = dict(running=1, waiting=0, kv_slots_used=0, kv_slots_total=10)
    for total, reqs in ((0, 0), (2, 3), (2, 3), (5, 9)):
        m.set_state(dict(base, retractions=total, retracted_requests=reqs, new_token_ratio=0.5))
    s = _samples(m.render().decode())
    assert s["attnserve_retractions_total"] == 5 and s["attnserve_retracted_requests_total"] == 9
    assert s["attnserve_new_token_ratio"] == 0.5


def test_speculative_metrics_from_engine_totals():
    m = ServerMetrics("s")
    base = dict(running=1, waiting=0, kv_slots_used=0, kv_slots_total=10)
    for verifies, length in ((4, 2.5), (10, 3.0)):
        m.set_state(dict(base, spec_verify=verifies, spec_accept_length=length))
    s = _samples(m.render().decode())
    assert s["attnserve_spec_verify_total"] == 10 and s["attnserve_spec_accept_length"] == 3.0


def test_kv_cache_bytes_labelled_with_its_dtype():
    m = ServerMetrics("k")
    m.set_state(dict(running=0, waiting=0, kv_slots_used=0, kv_slots_total=10, kv_cache_bytes=4096,
                     kv_cache_dtype="float8_e4m3fn"))
    s = _samples(m.render().decode())
    assert s["attnserve_kv_cache_bytes,kv_cache_dtype=float8_e4m3fn"] == 4096


def test_live_metrics(server, client):
    before = _samples(client.get("/metrics").text)
    r = client.post("/v1/completions", json={"prompt": "One two three", "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True})
    usage = r.json()["usage"]
    server.wait_idle()
    resp = client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = _samples(resp.text)
    assert after["attnserve_prompt_tokens_total"] - before["attnserve_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["attnserve_kv_cache_bytes,kv_cache_dtype=float32"] > 0  # the CPU server's pool
    assert after["attnserve_generation_tokens_total"] - before["attnserve_generation_tokens_total"] == 5
    assert after["attnserve_requests_total,finish_reason=length"] - before.get(
        "attnserve_requests_total,finish_reason=length", 0) == 1
    assert after["attnserve_time_to_first_token_seconds_count"] - before[
        "attnserve_time_to_first_token_seconds_count"] == 1
    assert after["attnserve_inter_token_latency_seconds_count"] - before[
        "attnserve_inter_token_latency_seconds_count"] == 4
    assert after["attnserve_e2e_request_latency_seconds_count"] > before["attnserve_e2e_request_latency_seconds_count"]
    alloc = server.engine.model_runner.token_to_kv_pool_allocator
    assert after["attnserve_kv_slots_total"] == alloc.size and after["attnserve_kv_slots_used"] == 0
    assert after["attnserve_num_running_reqs"] == 0 and after["attnserve_num_waiting_reqs"] == 0
