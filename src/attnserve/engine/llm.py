"""Offline API: ``attnserve.LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from attnserve.engine.engine import Engine, GenerateOutput, Prompt
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import DEFAULT_MODEL, ServerArgs


class LLM:
    """Generate completions for a list of prompts with continuous batching.

    Args:
        model: packaged model name (``smollm2-135m`` default, ``gemma3-270m``), a ``.gguf``
            path, an HF directory, or a shape name with ``load_format="dummy"``.
        **kwargs: any `ServerArgs` field (``attention_backend``, ``page_size``, ``dtype``,
            ``device``, ``max_total_tokens``, ...).

    `shutdown` gives back all the memory the engine holds (`Engine.shutdown`); as a context
    manager the LLM shuts down when the ``with`` block ends, also on an exception.

    Example::

        with LLM() as llm:
            out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0), chat=True)
        print(out[0].text)
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.server_args = ServerArgs(model=model, **kwargs)
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
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        chat: bool = False,
        use_tqdm: bool = False,
    ) -> List[GenerateOutput]:
        """Run every prompt to completion; outputs are in prompt order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one `SamplingParams` for all prompts or one per prompt
                (default: ``SamplingParams()``).
            chat: wrap each text prompt in the model's chat template.

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
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        token_lists = [self.engine.tokenize(p, chat=chat) for p in prompts]
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
