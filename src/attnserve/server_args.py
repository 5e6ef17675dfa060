"""`ServerArgs`: every engine option, with SGLang's flag names.

`ServerArgs.add_cli_args` adds the flags to an argparse parser; `ServerArgs.from_cli_args`
builds the dataclass back; `ServerArgs.check` rejects impossible combinations with a
`ValueError` that says what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import List, Optional

DEFAULT_MODEL = "smollm2-135m"
#: ``--log-level`` values (the `logging` level names, case-insensitive)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ServerArgs:
    # model
    model: str = DEFAULT_MODEL
    tokenizer_path: Optional[str] = None  # a tokenizer directory instead of the checkpoint's (or a dummy shape's)
    trust_remote_code: bool = False  # transformers may run a tokenizer's own code (AutoTokenizer)
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    context_length: Optional[int] = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8_e4m3 | fp8_e5m2
    quantization: Optional[str] = None  # fp8: FP8 linears (models/layers/quantization)
    enable_fp8_lm_head: bool = False  # the LM head FP8 too (models/layers/quantization/lm_head.py)
    # attention
    attention_backend: Optional[str] = None
    prefill_attention_backend: Optional[str] = None
    decode_attention_backend: Optional[str] = None
    speculative_attention_mode: str = "prefill"  # prefill | decode
    # speculative decoding (SGLang's flags; attnserve.speculative_config)
    speculative_algorithm: Optional[str] = None  # NGRAM | STANDALONE
    speculative_draft_model_path: Optional[str] = None
    speculative_draft_layers: Optional[int] = None  # self-draft: the target's first K layers
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_max_bfs_breadth: int = 10
    enable_deterministic_inference: bool = False
    triton_attention_num_kv_splits: int = 32  # most split-K partitions per request (decode)
    triton_attention_split_tile_size: int = 256  # tokens per split in deterministic mode
    # memory and scheduling
    page_size: int = 1
    max_total_tokens: Optional[int] = None
    mem_fraction_static: Optional[float] = None  # None: the card less a reserve (engine/memory_sizing.py)
    max_running_requests: Optional[int] = None  # None: from the KV pool (engine/memory_sizing.py); CPU 64
    chunked_prefill_size: Optional[int] = None  # None: from the GPU's memory; CPU 8192
    enable_mixed_chunk: bool = False
    max_queued_requests: Optional[int] = None
    disable_overlap_schedule: Optional[bool] = None  # None: overlap on CUDA, off on CPU
    disable_radix_cache: bool = False
    schedule_policy: str = "lpm"  # lpm | fcfs
    #: SGLang's: scales the admission estimate of future KV use (`AdmissionPolicy.for_conservativeness`)
    schedule_conservativeness: float = 1.0
    # CUDA graphs
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None  # None: from the GPU's memory (512 on 80 GB cards, 1024 above)
    cuda_graph_bs: Optional[List[int]] = None
    disable_fused_kernels: bool = False  # PyTorch norms / RoPE / gates / KV store / linear on CUDA
    # server
    graceful_shutdown_timeout: float = 30.0  # seconds running requests get after SIGTERM
    tool_call_parser: Optional[str] = None  # llama3 | qwen25 | hermes | mistral | gpt-oss (server/parsers)
    reasoning_parser: Optional[str] = None  # deepseek-r1 | qwen3 | gpt-oss (server/parsers)
    chat_template: Optional[str] = None  # Jinja file or template text (model_loader/chat_template.py)
    allowed_origins: Optional[List[str]] = None  # CORS origins of the HTTP server; None: no CORS headers
    # tensor parallelism (attnserve.distributed)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None  # host:port of node 0 (--nnodes > 1)
    dist_timeout: float = 600.0  # seconds a collective or the rendezvous may wait
    disable_custom_all_reduce: bool = False  # NCCL for every all-reduce (distributed/custom_all_reduce.py)
    disable_allreduce_fusion: bool = False  # all-reduce and the next RMSNorm apart (layers/allreduce_fusion.py)
    # data parallelism (attnserve.server.data_parallel): replicas of --tp-size GPUs each
    dp_size: int = 1
    load_balance_method: str = "prefix_affinity"  # prefix_affinity | shortest_queue | round_robin
    # misc
    random_seed: int = 0
    log_level: str = "info"
    skip_server_warmup: bool = False  # no start-up warm-up (engine/warmup.py; it runs on CUDA only)
    engine_process: str = "auto"  # serve: the engine in a process of its own (auto: on CUDA); server/engine_client.py

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self):
        import torch

        table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype == "auto":
            return torch.float32 if self.resolved_device() == "cpu" else torch.bfloat16
        return table[self.dtype]

    def resolved_kv_cache_dtype(self):
        """Storage dtype of the KV cache (`attnserve.mem_cache.kv_quant.KV_CACHE_DTYPES`)."""
        from attnserve.mem_cache.kv_quant import resolve_kv_cache_dtype

        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.resolved_dtype())

    def check(self) -> None:
        """Raise ValueError for invalid values or combinations (message says what to do)."""
        from attnserve.mem_cache.kv_quant import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        # (a QuantizationConfig object is also accepted, from Python: tests and tools)
        if self.quantization is not None and self.quantization != "fp8" and not hasattr(self.quantization,
                                                                                          "weight_strategy"):
            raise ValueError(f"--quantization must be fp8 (or unset), got {self.quantization!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ValueError(f"--load-format must be auto, gguf, safetensors or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda was given but no CUDA device is available; use --device cpu")
        from attnserve.attention.registry import get_attention_backend_class

        for name in (self.attention_backend, self.prefill_attention_backend, self.decode_attention_backend):
            if name:
                get_attention_backend_class(name)  # ValueError listing the valid names
        if not self.schedule_conservativeness > 0:
            raise ValueError(f"--schedule-conservativeness must be > 0 (1.0: SGLang's default), got "
                             f"{self.schedule_conservativeness}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.triton_attention_num_kv_splits < 1 or self.triton_attention_split_tile_size < 1:
            raise ValueError(
                "--triton-attention-num-kv-splits and --triton-attention-split-tile-size must be >= 1, got "
                f"{self.triton_attention_num_kv_splits} and {self.triton_attention_split_tile_size}"
            )
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1:
            raise ValueError(f"--chunked-prefill-size must be >= 1, or -1 to prefill every prompt whole (SGLang's "
                             f"'disabled'), got {self.chunked_prefill_size}")
        if str(self.log_level).lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1 (or left out for the model's own), got "
                             f"{self.context_length}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens {self.max_total_tokens} is below one page ({self.page_size})")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.speculative_attention_mode not in ("prefill", "decode"):
            raise ValueError("--speculative-attention-mode must be 'prefill' or 'decode'")
        from attnserve.speculative_config import SpeculativeConfig

        SpeculativeConfig.from_server_args(self)  # ValueError naming the flag
        if self.speculative_algorithm is not None:
            if self.disable_overlap_schedule is False:
                raise ValueError("speculative decoding runs without overlap scheduling: "
                                 "disable_overlap_schedule=False cannot be combined with --speculative-algorithm")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError("--cuda-graph-bs needs positive batch sizes")
        if self.disable_cuda_graph and self.cuda_graph_requested():
            raise ValueError("--disable-cuda-graph contradicts --cuda-graph-bs/--cuda-graph-max-bs; drop one")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(f"--graceful-shutdown-timeout must be >= 0 seconds, got {self.graceful_shutdown_timeout}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"--schedule-policy must be lpm or fcfs, got {self.schedule_policy!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        self._check_parallel()  # (--tool-call-parser / --reasoning-parser: server.launch checks them)
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        """``--dp-size`` / ``--load-balance-method`` (replica i takes GPUs [i*tp, (i+1)*tp))."""
        methods = ("prefix_affinity", "shortest_queue", "round_robin")  # distributed/dp_balancer.py's
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.load_balance_method not in methods:
            raise ValueError(f"--load-balance-method must be one of {', '.join(methods)}, "
                             f"got {self.load_balance_method!r}")
        if self.dp_size == 1:
            return
        if self.nnodes > 1:
            raise ValueError("--dp-size > 1 runs its replicas on one node; drop --nnodes or use --dp-size 1")
        if self.engine_process == "off":
            raise ValueError("--dp-size > 1 runs every replica in an engine process; drop --engine-process off")
        if self.resolved_device() == "cuda":
            import torch

            need = self.dp_size * self.tp_size
            if need > torch.cuda.device_count():
                raise ValueError(f"--dp-size {self.dp_size} x --tp-size {self.tp_size} needs {need} GPUs, but "
                                 f"{torch.cuda.device_count()} are visible")

    def _check_parallel(self) -> None:
        """The tensor-parallel flags (the heads are checked once the model config is read)."""
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) and --nnodes >= 1, got node rank "
                             f"{self.node_rank} of {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(the same number of ranks on every node)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address, reachable from "
                             "every node)")
        if self.dist_init_addr and (":" not in self.dist_init_addr
                                    or not self.dist_init_addr.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.tp_size == 1:
            return
        if self.speculative_algorithm is not None:
            raise ValueError("speculative decoding does not run tensor-parallel yet; drop --speculative-algorithm "
                             "or use --tp-size 1")
        if self.resolved_device() == "cuda":
            import torch

            local = self.tp_size // self.nnodes
            if local > torch.cuda.device_count():
                raise ValueError(f"--tp-size {self.tp_size} over {self.nnodes} node(s) needs {local} GPUs on "
                                 f"this node, but it has {torch.cuda.device_count()}")

    def overlap_schedule_enabled(self, device_type: str) -> bool:
        """Overlap scheduling: on by default on CUDA (where it hides the host's work behind
        the GPU's), off on CPU (nothing to hide); ``disable_overlap_schedule`` True/False
        forces it off/on on any device."""
        if self.disable_overlap_schedule is None:
            return device_type == "cuda" and self.speculative_algorithm is None
        return not self.disable_overlap_schedule

    def cuda_graph_requested(self) -> bool:
        """True when the user explicitly configured CUDA graphs."""
        return self.cuda_graph_bs is not None or self.cuda_graph_max_bs is not None

    # ---- argparse ----------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs()
        a = parser.add_argument
        a("--model", "--model-path", dest="model", default=d.model,
          help="packaged model name (smollm2-135m, gemma3-270m), a .gguf file, an HF directory, "
               "or with --load-format dummy a shape name (llama-3-8b)")
        a("--tokenizer-path", default=None,
          help="tokenizer directory to use instead of the checkpoint's; also gives a --load-format dummy shape "
               "a tokenizer (its vocabulary must fit the model's)")
        a("--trust-remote-code", action="store_true",
          help="let transformers run the code a tokenizer directory ships (AutoTokenizer's trust_remote_code)")
        a("--load-format", default=d.load_format, choices=["auto", "gguf", "safetensors", "dummy"])
        a("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
        a("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        a("--context-length", type=int, default=None, help="override the model's context length")
        a("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "fp8_e4m3", "fp8_e5m2"],
          help="KV cache storage: auto (the model dtype) or FP8 with per-layer scales (half the bytes of bf16)")
        a("--quantization", default=d.quantization, choices=["fp8"],
          help="fp8: FP8 e4m3 linear weights, quantised at load (FP8 checkpoints load as FP8 without it)")
        a("--enable-fp8-lm-head", action="store_true",
          help="with FP8 weights, quantise the LM head too (per-row e4m3; by default it keeps the model dtype)")
        a("--attention-backend", default=None, help="backend for every phase (torch_native, triton, ...)")
        a("--prefill-attention-backend", default=None, help="backend for EXTEND/MIXED steps")
        a("--decode-attention-backend", default=None, help="backend for DECODE steps")
        a("--speculative-attention-mode", default=d.speculative_attention_mode, choices=["prefill", "decode"])
        a("--speculative-algorithm", default=None, type=str.upper, choices=["NGRAM", "STANDALONE"],
          help="NGRAM: draft from the request's own prompt and output; STANDALONE: a draft model")
        a("--speculative-draft-model-path", default=None, help="draft model (STANDALONE), sharing the tokenizer")
        a("--speculative-draft-layers", type=int, default=None,
          help="STANDALONE self-draft: the target's first K layers and its head draft (no second model)")
        a("--speculative-num-steps", type=int, default=None, help="draft decode steps per verify (STANDALONE)")
        a("--speculative-eagle-topk", type=int, default=None, help="candidates expanded per draft step")
        a("--speculative-num-draft-tokens", type=int, default=None,
          help="tokens verified per request and step, the last sampled one included")
        a("--speculative-ngram-min-match-window-size", type=int, default=d.speculative_ngram_min_match_window_size)
        a("--speculative-ngram-max-match-window-size", type=int, default=d.speculative_ngram_max_match_window_size)
        a("--speculative-ngram-max-bfs-breadth", type=int, default=d.speculative_ngram_max_bfs_breadth)
        a("--enable-deterministic-inference", action="store_true",
          help="batch-invariant attention (fixed split sizes)")
        a("--triton-attention-num-kv-splits", type=int, default=d.triton_attention_num_kv_splits,
          help="most split-K partitions per request in the Triton decode kernels (the heuristic picks fewer "
               "for short sequences and large batches)")
        a("--triton-attention-split-tile-size", type=int, default=d.triton_attention_split_tile_size,
          help="tokens per split with --enable-deterministic-inference")
        a("--page-size", type=int, default=d.page_size, help="tokens per KV page")
        a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
        a("--mem-fraction-static", type=float, default=d.mem_fraction_static,
          help="fraction of the GPU's memory for weights + KV pool (the pool takes what the weights leave; "
               "default: the card less SGLang's reserve, 0.874 on an 80 GB H100 at tp 1)")
        a("--max-running-requests", type=int, default=None,
          help="most requests in one step (default: KV pool tokens / 64, at most 1024; 64 on CPU)")
        a("--chunked-prefill-size", type=int, default=None,
          help="max prompt tokens prefilled per step (default: from the GPU's memory, 8192 on 80 GB cards; "
               "8192 on CPU); -1 prefills every prompt whole")
        a("--enable-mixed-chunk", action="store_true", help="prefill and decode in the same step")
        a("--max-queued-requests", type=int, default=None)
        a("--disable-radix-cache", action="store_true", help="no prefix caching across requests")
        a("--schedule-policy", default=d.schedule_policy, choices=["lpm", "fcfs"],
          help="lpm: longest cached prefix first (fcfs when the queue is long); fcfs: arrival order")
        a("--schedule-conservativeness", type=float, default=d.schedule_conservativeness,
          help="scale the admission estimate of each running request's future KV use (SGLang's: > 1 admits "
               "fewer requests and retracts less, < 1 admits more)")
        a("--disable-overlap-schedule", action="store_const", const=True, default=None,
          help="process each step's results before launching the next (overlap is on by default on CUDA)")
        a("--disable-cuda-graph", action="store_true")
        a("--cuda-graph-max-bs", type=int, default=None,
          help="largest captured decode batch (default: from the GPU's memory, 256 on 80 GB cards, at most "
               "--max-running-requests)")
        a("--cuda-graph-bs", type=int, nargs="+", default=None)
        a("--disable-fused-kernels", action="store_true",
          help="run the PyTorch norms, RoPE, gates, skinny linears and KV-cache writes on CUDA instead of "
               "attnserve's fused Triton kernels (to compare or to rule them out)")
        a("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
          help="on SIGTERM, seconds running requests get to finish before they are ended with an error")
        a("--tool-call-parser", default=None,
          help="read tool calls out of chat outputs: llama3, qwen25, hermes, mistral or gpt-oss (server/parsers)")
        a("--reasoning-parser", default=None,
          help="split the thinking (<think>...</think>; gpt-oss: the analysis channel) into reasoning_content: "
               "deepseek-r1, qwen3 or gpt-oss")
        a("--chat-template", default=None,
          help="chat template: a Jinja file, or the template text itself (default: the model's own)")
        a("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
          help="serve: CORS origins allowed to call the server from a browser ('*' for any); none by default")
        a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=d.tp_size,
          help="tensor-parallel ranks (one process each; NCCL on CUDA, gloo on CPU)")
        a("--nnodes", type=int, default=d.nnodes, help="machines the tensor-parallel ranks span")
        a("--node-rank", type=int, default=d.node_rank, help="this machine's index in [0, --nnodes)")
        a("--dist-init-addr", default=None, help="host:port of node 0 for the rendezvous (--nnodes > 1)")
        a("--dist-timeout", type=float, default=d.dist_timeout,
          help="seconds a collective or the rendezvous may wait before failing")
        a("--disable-custom-all-reduce", action="store_true",
          help="run every tensor-parallel all-reduce through NCCL instead of the one-shot / two-shot kernels over "
               "symmetric memory used for small messages on CUDA")
        a("--disable-allreduce-fusion", action="store_true",
          help="tensor parallelism: keep each row-parallel layer's all-reduce apart from the residual add and "
               "RMSNorm after it (by default one kernel does the three for messages the one-shot custom "
               "all-reduce takes)")
        a("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=d.dp_size,
          help="data-parallel replicas, each of --tp-size GPUs (replica i on GPUs [i*tp, (i+1)*tp)) in an engine "
               "process of its own, behind one server")
        a("--load-balance-method", default=d.load_balance_method,
          choices=["prefix_affinity", "shortest_queue", "round_robin"],
          help="--dp-size > 1: how requests are spread; prefix_affinity is shortest_queue with requests that "
               "share a prompt prefix kept on one replica (its radix cache) while it is not overloaded")
        a("--random-seed", type=int, default=d.random_seed)
        a("--log-level", default=d.log_level, type=str.lower, choices=LOG_LEVELS)
        a("--skip-server-warmup", action="store_true",
          help="start without compiling every kernel variant first (engine/warmup.py; CUDA only): faster start-up, "
               "slower first requests")
        a("--engine-process", default=d.engine_process, choices=["auto", "on", "off"],
          help="serve: run the scheduler in a process of its own, apart from HTTP, tokenization and streaming "
               "(auto: on CUDA; off: a thread of the HTTP process)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
