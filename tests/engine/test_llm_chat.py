"""Offline ``LLM.chat`` (issue 36, item 3): whole conversations through the chat template,
a batch of them, a per-call template, ``continue_final_message`` and
``chat_template_kwargs``; bad options are ValueErrors. Uses the shared SmolLM2 engine."""

import pytest

from attnserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)
Q = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = Q + [{"role": "assistant", "content": "The capital of France is"}]


def _ids(out):
    return out["input_ids"] if hasattr(out, "keys") else out


def test_chat_batch_renders_the_model_template(llm):
    tok = llm.tokenizer
    two = [Q, [{"role": "system", "content": "Answer briefly."}, *Q]]
    outs = llm.chat(two, GREEDY)
    assert len(outs) == 2
    for conv, out in zip(two, outs):
        assert out.prompt_token_ids == list(_ids(tok.apply_chat_template(conv, add_generation_prompt=True)))
        assert len(out.token_ids) == 2
    single = llm.chat(Q, GREEDY)[0]  # one conversation: same answer as inside the batch
    assert single.token_ids == outs[0].token_ids and single.prompt_token_ids == outs[0].prompt_token_ids


def test_chat_continue_template_and_kwargs(llm):
    tok = llm.tokenizer
    cont = llm.chat(PREFILL, ONE, continue_final_message=True)[0]
    closed = list(_ids(tok.apply_chat_template(PREFILL, add_generation_prompt=False)))
    assert closed == cont.prompt_token_ids + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode("\n")
    assert tok.decode(cont.prompt_token_ids).endswith("<|im_start|>assistant\nThe capital of France is")
    template = "{% for m in messages %}<<{{ m['role'] }}{% if tag %}:{{ tag }}{% endif %}>> {{ m['content'] }}\n" \
               "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
    out = llm.chat(Q, ONE, chat_template=template, chat_template_kwargs={"tag": "T1"})[0]
    assert tok.decode(out.prompt_token_ids) == "<<user:T1>> What is the capital of France?\n<<assistant>>"


def test_chat_bad_options_are_value_errors(llm):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(PREFILL, GREEDY, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat(Q, GREEDY, chat_template_kwargs={"tokenize": False})
    with pytest.raises(ValueError, match="boom"):
        llm.chat(Q, GREEDY, chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], GREEDY)
    assert len(llm.chat(Q, ONE)[0].token_ids) == 1  # the engine still serves
