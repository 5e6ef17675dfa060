"""The serving benchmark against the running test server: table, JSON record and PNG."""

import json
import os
import subprocess
import sys


def test_serving_benchmark_writes_results(server, api_key, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "attnserve.bench.serving", "--base-url", server.base_url, "--api-key", api_key,
           "--num-prompts", "6", "--input-len", "4", "24", "--output-len", "2", "5", "--max-concurrency", "1", "3",
           "--warmup", "1", "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath("src")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TTFT ms" in r.stdout and "out tok/s" in r.stdout
    files = sorted(os.listdir(out))
    jsons = [f for f in files if f.endswith(".json")]
    assert len(jsons) == 1 and jsons[0].startswith("cpu-serving-") and jsons[0][:-5] + ".png" in files
    assert os.path.getsize(out / (jsons[0][:-5] + ".png")) > 10_000
    rec = json.loads((out / jsons[0]).read_text())
    assert rec["device"] == "cpu" and rec["model"] == "smollm2-135m" and rec["versions"]["server"]["torch"]
    assert rec["args"]["num_prompts"] == 6 and rec["date"]
    assert [run["max_concurrency"] for run in rec["runs"]] == [1, 3]
    for run in rec["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        assert 12 <= s["total_output_tokens"] <= 30  # ignore_eos: exactly the sampled lengths
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
        assert s["ttft_ms"]["mean"] <= s["e2e_ms"]["mean"]
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    server.wait_idle(timeout=10)
