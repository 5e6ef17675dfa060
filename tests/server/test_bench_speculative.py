"""The speculative-decoding benchmark in-process on CPU, tiny settings: one JSON record whose
rows hold the baseline and each draft count, with outputs identical to the baseline."""

import json

from attnserve.bench.speculative import main


def test_speculative_benchmark_writes_results(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["--device", "cpu", "--max-new-tokens", "8", "--num-draft-tokens", "1", "4", "--max-bfs-breadth", "1",
                 "--repeats", "1", "--requests", "1", "--workload", "edit", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 1 and files[0].startswith("cpu-speculative-") and files[0].endswith(".json")
    rec = json.loads((out / files[0]).read_text())
    assert rec["device"] == "cpu" and rec["model"] == "smollm2-135m" and rec["torch"] and rec["transformers"]
    assert rec["args"]["num_draft_tokens"] == [1, 4] and rec["date"]
    rows = rec["rows"]
    assert [(r["workload"], r["num_draft_tokens"], r["max_bfs_breadth"]) for r in rows] == [
        ("edit", None, None), ("edit", 1, 1), ("edit", 4, 1)]
    base = rows[0]
    assert base["speculative"] is False and base["accept_length"] is None and base["speedup"] == 1.0
    for r in rows:
        assert r["identical"] is True
        assert r["output_tokens"] == base["output_tokens"] > 0 and r["output_tokens_per_s"] > 0 and r["wall_s"] > 0
    for r in rows[1:]:
        assert r["speculative"] is True and r["accept_length"] >= 1 and r["stats_accept_length"] >= 1
    assert rows[2]["accept_length"] > 1.5  # the paragraph is in the prompt: 4-node drafts mostly match
    assert "speedup" in capsys.readouterr().out
