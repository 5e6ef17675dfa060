"""SGLang launch flags that attnserve does not implement as SGLang does, each either taken
(where attnserve already does what the flag asks) or refused with what to do instead.

A user moving from ``python -m sglang.launch_server ...`` keeps their command line: a flag
whose value matches attnserve's behaviour is accepted and changes nothing, any other value
(and any flag attnserve cannot honour) stops the launch with one ``error:`` line that names
the flag and says what attnserve does instead, not argparse's bare "unrecognized
arguments". Flags attnserve implements are ordinary options of `ServerArgs.add_cli_args`.

Flag names and meanings: SGLang's ``server_args.py`` (``ServerArgs.add_cli_args``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class SGLangFlag:
    """One SGLang flag.

    Attributes:
        names: the option strings (``--enable-torch-compile``).
        takes_value: the flag takes one value (else it is a switch).
        accepted: values taken as they are (compared as strings; a float is also compared as
            a number); a switch with ``accepted == ("on",)`` is taken.
        reason: what attnserve does instead (the error message's second half; for a taken
            flag, why taking it changes nothing).
    """

    names: Tuple[str, ...]
    takes_value: bool
    accepted: Tuple[str, ...]
    reason: str

    def takes(self, value: Optional[str]) -> bool:
        """True when ``value`` (None for a switch) is what attnserve does anyway."""
        if not self.takes_value:
            return "on" in self.accepted
        if value in self.accepted:
            return True
        try:
            return any(float(value) == float(a) for a in self.accepted)
        except (TypeError, ValueError):
            return False


_REQUEST_LOGS = ("request contents are not logged: the HTTP server logs one line a request (method, path, "
                 "status) at --log-level-http info, and /metrics exports request counts, tokens and latencies")
_GRAPHS = "its decode steps already run as CUDA graphs of its own Triton kernels (--cuda-graph-max-bs sizes them)"

#: the flags, in SGLang's groups (model, serving, scheduling, kernels, parallelism, others)
SGLANG_FLAGS: Tuple[SGLangFlag, ...] = (
    SGLangFlag(("--revision",), True, (), "attnserve loads a local checkpoint (an HF directory or a .gguf file) "
               "and downloads nothing; fetch the revision first (huggingface-cli download MODEL --revision R)"),
    SGLangFlag(("--download-dir",), True, (), "attnserve loads a local checkpoint (an HF directory or a .gguf "
               "file) and downloads nothing; pass the downloaded directory as --model-path"),
    SGLangFlag(("--tokenizer-mode",), True, ("auto",), "the tokenizer is transformers' AutoTokenizer (the fast "
               "one where the checkpoint has it); only --tokenizer-mode auto"),
    SGLangFlag(("--skip-tokenizer-init",), False, (), "the checkpoint's tokenizer is always loaded; token-id "
               "prompts (/generate input_ids, /v1/completions token lists) are served as they are"),
    SGLangFlag(("--json-model-override-args",), True, (), "edit the checkpoint's config.json instead"),
    SGLangFlag(("--hf-chat-template-name",), True, (), "pass the template with --chat-template (a Jinja file "
               "or the template text)"),
    SGLangFlag(("--is-embedding",), False, (), "attnserve serves generative models only"),
    SGLangFlag(("--lora-paths",), True, (), "LoRA adapters are not supported; merge the adapter into the "
               "weights first"),
    SGLangFlag(("--cpu-offload-gb",), True, ("0",), "weights stay on the GPU; only --cpu-offload-gb 0"),
    SGLangFlag(("--enable-cache-report",), False, ("on",), "cached prompt tokens are always reported "
               "(usage.prompt_tokens_details.cached_tokens)"),
    SGLangFlag(("--stream-interval",), True, ("1",), "each token is streamed as soon as its step ends; only "
               "--stream-interval 1"),
    SGLangFlag(("--allow-auto-truncate",), False, (), "a prompt longer than the context is refused with a 400 "
               "that names both lengths; truncate it on the client"),
    SGLangFlag(("--preferred-sampling-params",), True, (), "send the sampling parameters with each request"),
    SGLangFlag(("--file-storage-path",), True, (), "there is no files API"),
    SGLangFlag(("--log-requests",), False, (), _REQUEST_LOGS),
    SGLangFlag(("--log-requests-level",), True, (), _REQUEST_LOGS),
    SGLangFlag(("--show-time-cost",), False, (), "time a decode step's kernels with benchmarks/profile_step.py; "
               "per-request latencies are on /metrics"),
    SGLangFlag(("--watchdog-timeout",), True, (), "there is no batch watchdog; GET /health_generate answers 503 "
               "when the engine does not produce a token in time"),
    SGLangFlag(("--max-prefill-tokens",), True, (), "a step's prefill tokens are bounded by --chunked-prefill-size; "
               "pass that instead"),
    SGLangFlag(("--max-micro-batch-size",), True, (), "bound a step's requests with --max-running-requests"),
    SGLangFlag(("--enable-torch-compile",), False, (), f"attnserve does not use torch.compile: {_GRAPHS}; drop the "
               "flag"),
    SGLangFlag(("--torch-compile-max-bs",), True, (), f"attnserve does not use torch.compile: {_GRAPHS}"),
    SGLangFlag(("--disable-cuda-graph-padding",), False, (), "a batch between captured sizes replays the next "
               "larger graph; capture the sizes you need with --cuda-graph-bs, or --disable-cuda-graph"),
    SGLangFlag(("--sampling-backend",), True, ("pytorch",), "attnserve samples with its own PyTorch / Triton "
               "sampler; only --sampling-backend pytorch"),
    SGLangFlag(("--grammar-backend",), True, ("xgrammar",), "structured outputs use xgrammar (pip install "
               "'attnserve[grammar]'); only --grammar-backend xgrammar"),
    SGLangFlag(("--constrained-json-whitespace-pattern",), True, (), "constrained JSON is written on one line "
               "with ', ' and ': ' separators"),
    SGLangFlag(("--base-gpu-id",), True, ("0",), "choose the GPUs with CUDA_VISIBLE_DEVICES (attnserve uses the "
               "visible ones from cuda:0); only --base-gpu-id 0"),
    SGLangFlag(("--enable-p2p-check",), False, ("on",), "peer access is always checked before the custom "
               "all-reduce is used (NCCL where it is missing)"),
    SGLangFlag(("--enable-dp-attention",), False, (), "data-parallel attention inside a tensor-parallel model is "
               "not implemented; --dp-size runs whole replicas"),
    SGLangFlag(("--enable-hierarchical-cache",), False, (), "the prefix cache lives in GPU memory only"),
)


class _SGLangFlagAction(argparse.Action):
    """Take the flag when `SGLangFlag.takes` its value, else stop with a parser error."""

    def __init__(self, option_strings, dest, flag: SGLangFlag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, nargs=None if flag.takes_value else 0, default=argparse.SUPPRESS,
                         **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = values if self.flag.takes_value else None
        if not self.flag.takes(value):
            shown = f"{option_string} {value}" if value is not None else option_string
            parser.error(f"{shown}: not supported by attnserve: {self.flag.reason}")


def add_sglang_flags(parser: argparse.ArgumentParser, flags: Sequence[SGLangFlag] = SGLANG_FLAGS) -> None:
    """Register ``flags`` on ``parser`` (the values never reach the parsed namespace)."""
    for flag in flags:
        help_text = f"SGLang's flag: {flag.reason}" + (f" (taken: {', '.join(flag.accepted)})"
                                                        if flag.accepted and flag.takes_value else "")
        parser.add_argument(*flag.names, action=_SGLangFlagAction, flag=flag, dest="_sglang_" + flag.names[0][2:],
                            help=argparse.SUPPRESS if not flag.accepted else help_text)
