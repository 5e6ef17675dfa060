"""Offline API: ``attnserve.LLM(model=...).generate(prompts, sampling_params)`` and
``LLM.chat(conversations, sampling_params)``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from attnserve.engine.engine import Engine, GenerateOutput, Prompt
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import DEFAULT_MODEL, ServerArgs


class LLM:
    """Generate completions for a list of prompts with continuous batching.

    Args:
        model: packaged model name (``smollm2-135m`` default, ``gemma3-270m``), a ``.gguf``
            path, an HF directory, or a shape name with ``load_format="dummy"``
            (``model_path=``, SGLang's name, is taken too).
        **kwargs: any `ServerArgs` field (``attention_backend``, ``page_size``, ``dtype``,
            ``device``, ``max_total_tokens``, ...).

    `shutdown` gives back all the memory the engine holds (`Engine.shutdown`); as a context
    manager the LLM shuts down when the ``with`` block ends, also on an exception.

    Example::

        with LLM() as llm:
            out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0), chat=True)
        print(out[0].text)
    """

    def __init__(self, model: Optional[str] = None, **kwargs):
        from attnserve.model_loader.chat_template import load_chat_template

        model_path = kwargs.pop("model_path", None)  # SGLang's name (sgl.Engine(model_path=...))
        if model is not None and model_path is not None and model != model_path:
            raise ValueError(f"LLM got model={model!r} and model_path={model_path!r}; pass one of them")
        self.server_args = ServerArgs(model=model or model_path or DEFAULT_MODEL, **kwargs)
        #: ``chat_template`` (a Jinja file or text) as Jinja source, or None: the model's own
        self.chat_template = load_chat_template(self.server_args.chat_template)
        self.engine = Engine(self.server_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Release every device allocation of the engine: CUDA graphs and their memory pool,
        KV pools, ``req_to_token``, weights, attention workspaces, the scheduler's buffers
        (`Engine.shutdown`); stops tensor-parallel ranks. Idempotent; `generate` raises
        RuntimeError afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.shutdown()
        return False

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Optional[Union[SamplingParams, Dict[str, Any], Sequence[Any]]] = None,
        chat: bool = False,
        use_tqdm: bool = False,
    ) -> List[GenerateOutput]:
        """Run every prompt to completion; outputs are in prompt order (a prompt whose
        params have ``n`` > 1 gives its ``n`` outputs in a row, as SGLang returns them).

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one `SamplingParams` for all prompts or one per prompt
                (default: ``SamplingParams()``); a dict of its fields (SGLang's offline
                form, e.g. ``{"temperature": 0, "max_new_tokens": 32}``) stands for one.
            chat: wrap each text prompt, as one user message, in the chat template (the
                LLM's ``chat_template``, else the model's own). For whole conversations
                and template options use `chat`.

        Raises:
            ValueError: an empty prompt list, an empty or over-long prompt, invalid sampling
                parameters. Every prompt is checked before any is enqueued, so a bad one
                leaves the engine untouched.
            RuntimeError: the LLM was shut down.
        """
        self.engine.check_running()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("the prompt list is empty")
        params = per_prompt_params(sampling_params, len(prompts), "prompts")
        if chat and self.chat_template is not None and any(isinstance(p, str) for p in prompts):
            token_lists = [self._render([{"role": "user", "content": p}], self.chat_template, None, False, None, None)
                           if isinstance(p, str) and p else self.engine.tokenize(p) for p in prompts]
        else:
            token_lists = [self.engine.tokenize(p, chat=chat) for p in prompts]
        return self._run(token_lists, params, use_tqdm)

    def chat(
        self,
        messages: Union[Sequence[Dict[str, Any]], Sequence[Sequence[Dict[str, Any]]]],
        sampling_params: Optional[Union[SamplingParams, Dict[str, Any], Sequence[Any]]] = None,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: Optional[bool] = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        use_tqdm: bool = False,
    ) -> List[GenerateOutput]:
        """Generate the next assistant turn of one conversation or of several.

        Args:
            messages: one conversation (a list of ``{"role", "content", ...}`` dicts) or a
                list of conversations.
            sampling_params: one for all conversations or one per conversation (a
                `SamplingParams` or a dict of its fields, as in `generate`).
            tools: OpenAI-style tool definitions, rendered by the template's tool support.
            chat_template: a Jinja file or template text for this call (default: the
                LLM's ``chat_template``, else the model's own).
            add_generation_prompt: append the assistant header; default True, or False
                with ``continue_final_message``.
            continue_final_message: leave the last (assistant) message open so the output
                continues it: no end-of-turn token, no new header. True together with
                ``add_generation_prompt=True`` is a ValueError.
            chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).

        Returns:
            one `GenerateOutput` per conversation and sample (``n``), in order
            (``prompt_token_ids`` is the rendered conversation).

        Raises:
            ValueError: an empty list, a conversation the template cannot render (the
                template's message), conflicting options, or anything `generate` refuses.
            RuntimeError: the LLM was shut down.
        """
        from attnserve.model_loader.chat_template import load_chat_template

        self.engine.check_running()
        convs = list(messages)
        if not convs:
            raise ValueError("messages is empty")
        if isinstance(convs[0], dict):
            convs = [convs]
        template = load_chat_template(chat_template) if chat_template is not None else self.chat_template
        token_lists = [self._render(list(c), template, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs, tools) for c in convs]
        params = per_prompt_params(sampling_params, len(convs), "conversations")
        return self._run(token_lists, params, use_tqdm)

    def _render(self, conversation, template, add_generation_prompt, continue_final_message, kwargs, tools):
        from attnserve.model_loader.chat_template import render_chat

        return render_chat(self.engine.tokenizer, conversation, chat_template=template,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           chat_template_kwargs=kwargs, tools=tools).token_ids

    def _run(self, token_lists: List[List[int]], params: List[SamplingParams], use_tqdm: bool) -> List[GenerateOutput]:
        """Check every prompt, enqueue them all (each ``n`` times), step until each is finished."""
        token_lists, params = expand_samples(token_lists, params)
        for ids, p in zip(token_lists, params):
            self.engine.check_prompt(ids, p)
        reqs = [self.engine.add_request(ids, p) for ids, p in zip(token_lists, params)]
        pbar = None
        if use_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(reqs), desc="generate")
        done = 0
        while any(not r.finished for r in reqs):
            self.engine.step()
            if pbar is not None:
                now = sum(r.finished for r in reqs)
                pbar.update(now - done)
                done = now
        self.engine.scheduler.flush()  # overlap: the last launched step's extra tokens are dropped
        if pbar is not None:
            pbar.close()
        outs = [GenerateOutput.from_req(r) for r in reqs]
        for r in reqs:
            self.engine.scheduler.forget(r.rid)
        return outs


def expand_samples(token_lists: List[List[int]], params: List[SamplingParams]) -> tuple:
    """``(token lists, params)`` with each prompt repeated ``n`` times in a row, copy ``i``
    with `SamplingParams.sample` ``(i)``'s params."""
    out_ids, out_params = [], []
    for ids, p in zip(token_lists, params):
        for i in range(p.n):
            out_ids.append(ids)
            out_params.append(p.sample(i))
    return out_ids, out_params


#: SGLang's names in its ``sampling_params`` dicts that differ from `SamplingParams`' fields
_SGLANG_NAMES = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def per_prompt_params(sampling_params: Any, count: int, what: str) -> List[SamplingParams]:
    """``count`` `SamplingParams` from what `LLM.generate` / `LLM.chat` take: None (the
    defaults), one `SamplingParams` or dict of its fields for every prompt, or a list or tuple
    of them, one per prompt. A dict may use SGLang's ``min_new_tokens`` and ``sampling_seed``
    for ``min_tokens`` and ``seed``.

    Raises:
        ValueError: a dict with a key that is not a `SamplingParams` field (named), a list of
            another length than ``count``, or anything else.
    """
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, (list, tuple)):
        params = [_one_params(p) for p in sampling_params]
        if len(params) != count:
            raise ValueError(f"{count} {what} but {len(params)} sampling params")
        return params
    return [_one_params(sampling_params)] * count


def _one_params(p: Any) -> SamplingParams:
    if isinstance(p, SamplingParams):
        return p
    if isinstance(p, dict):
        import dataclasses

        fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
        p = {_SGLANG_NAMES.get(k, k): v for k, v in p.items()}
        unknown = sorted(str(k) for k in p if k not in fields)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"SamplingParams takes {', '.join(sorted(fields))}")
        return SamplingParams(**p)
    raise ValueError(f"sampling_params must be a SamplingParams, a dict of its fields or a list of either, "
                     f"got {type(p).__name__}")
