"""SGLang's offline API shapes on `LLM` (real SmolLM2 on the CPU): outputs read as SGLang's
``{"text", "output_ids", "meta_info"}`` dicts, and ``LLM(model_path=...)``."""

import pytest

from attnserve.engine.llm import LLM

PROMPT = "The capital of France is"


def test_outputs_read_as_sglang_dicts(llm):
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    out = llm.generate([PROMPT], greedy)[0]
    assert out["text"] == out.text and out["output_ids"] == out.token_ids and len(out.token_ids) == 6
    meta = out["meta_info"]
    assert meta["id"] == out.rid and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(out.prompt_token_ids) and meta["completion_tokens"] == 6
    assert "output_token_logprobs" not in meta
    with pytest.raises(KeyError, match="attributes"):
        out["finish_reason"]
    # a stop token: the id that matched; a stop string: the string
    first = out.token_ids[1]
    by_id = llm.generate([PROMPT], dict(greedy, stop_token_ids=[first]))[0]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    stop = out.text.strip().split()[1] if len(out.text.split()) > 1 else out.text.strip()[:2]
    by_str = llm.generate([PROMPT], dict(greedy, stop=[stop]))[0]
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in by_str["text"]


def test_logprobs_in_sglang_entries(llm):
    out = llm.generate([PROMPT], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True, "logprobs": True,
                                  "top_logprobs": 2, "prompt_logprobs": True})[0]
    meta = out["meta_info"]
    assert [[lp, t] for lp, t, _ in meta["output_token_logprobs"]] == \
        [[lp, t] for t, lp in zip(out.token_ids, out.output_token_logprobs)]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert [[e[1] for e in row] for row in meta["output_top_logprobs"]] == \
        [[t for t, _ in row] for row in out.output_top_logprobs]
    # greedy: the chosen token is the most likely one
    assert [row[0][1] for row in meta["output_top_logprobs"]] == out.token_ids
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == out.prompt_token_ids and inputs[0][0] is None
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(inputs)


def test_model_path_is_sglangs_name_for_model():
    with LLM(model_path="llama-tiny", load_format="dummy", max_total_tokens=256) as llm:
        assert llm.server_args.model == "llama-tiny"
        assert len(llm.generate([[5, 6, 7]], {"max_new_tokens": 2, "ignore_eos": True})[0].token_ids) == 2
    with pytest.raises(ValueError, match="pass one of them"):
        LLM(model="llama-tiny", model_path="smollm2-135m", load_format="dummy")
