"""The contract between the engine and the attention backends.

* default selection as a table, with faked device capabilities; explicit impossible
  combinations are clear errors;
* capabilities declared on the class and forwarded by `HybridAttnBackend`;
* sliding windows: -1 (or None) is "no window" everywhere, 0 is refused; a window layer the
  backend has no metadata for is a clear error;
* backends are built from `AttentionBackendConfig`, never from the model runner.
"""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from attention_harness import backend_config, make_batch
from attnserve.attention.backend_config import AttentionBackendConfig, normalize_window
from attnserve.attention.hybrid import HybridAttnBackend
from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.selection import DeviceCaps, choose_backends, default_backend_name
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.forward_batch import ForwardMode
from attnserve.server_args import ServerArgs

CPU = DeviceCaps("cpu")
H100 = DeviceCaps("cuda", (9, 0), "H100")
A10 = DeviceCaps("cuda", (8, 6), "A10")
P100 = DeviceCaps("cuda", (6, 0), "P100")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on the CPU


@pytest.mark.parametrize("caps,arch,topk,page,want", [
    (CPU, "mha", 1, 1, "torch_native"),
    (CPU, "mla", 1, 64, "torch_native"),
    (H100, "mha", 1, 1, "triton"),
    (H100, "mla", 1, 64, "triton_mla"),
    (A10, "mha", 4, 16, "triton"),  # tree drafts and pages: triton has custom masks and any page size
    (A10, "mla", 4, 1, "triton_mla"),
])
def test_default_table(caps, arch, topk, page, want):
    name, reason = default_backend_name(caps, arch, topk, page)
    assert name == want and reason


def test_gpu_below_volta_has_no_default():
    with pytest.raises(ValueError, match="compute capability >= 7.0"):
        default_backend_name(P100, "mha")


@pytest.mark.parametrize("flags,caps,arch,match", [
    (dict(attention_backend="triton"), H100, "mla", "does not run MLA models; .*torch_native, triton_mla"),
    (dict(attention_backend="triton_mla"), H100, "mha", "does not run MHA models; .*torch_native, triton"),
    (dict(attention_backend="triton"), CPU, "mha", "needs a CUDA GPU; on CPU use --attention-backend torch_native"),
    (dict(decode_attention_backend="triton_mla"), CPU, "mla", "needs a CUDA GPU"),
    (dict(attention_backend="triton"), P100, "mha", "compute capability >= 7.0"),
    (dict(attention_backend="flashattn9000"), H100, "mha", "valid backends: .*torch_native"),
])
def test_explicit_impossible_combinations(flags, caps, arch, match):
    with pytest.raises(ValueError, match=match):
        choose_backends(ServerArgs(**flags), caps, arch)


def test_explicit_and_per_phase_choices():
    c = choose_backends(ServerArgs(prefill_attention_backend="torch_native"), H100, "mla")
    assert (c.prefill, c.decode) == ("torch_native", "triton_mla") and "per-phase" in c.reason
    c = choose_backends(ServerArgs(attention_backend="torch_native"), H100, "mha")
    assert (c.prefill, c.decode, c.reason) == ("torch_native", "torch_native", "--attention-backend")


def test_hybrid_forwards_capabilities():
    case = make_batch(ForwardMode.DECODE, [3], [1], 4, 2, 8, 1, seed=1)
    cfg = backend_config(case)
    native = TorchNativeAttnBackend(cfg)

    class Capturable(TorchNativeAttnBackend):  # a stand-in with the triton backend's declarations
        supports_cuda_graph = True
        replay_hook_is_capturable = True

    graphs = Capturable(cfg)
    assert HybridAttnBackend(native, graphs).supports_cuda_graph is True
    assert HybridAttnBackend(native, graphs).replay_hook_is_capturable is True
    assert HybridAttnBackend(graphs, native).supports_cuda_graph is False
    assert HybridAttnBackend(graphs, native).replay_hook_is_capturable is False
    assert TorchNativeAttnBackend.supports_cuda_graph is False


@pytest.mark.parametrize("w,want", [(None, -1), (-1, -1), (1, 1), (511, 511)])
def test_window_convention(w, want):
    assert normalize_window(w) == want
    assert RadixAttention(4, 8, 0.3, 2, 0, sliding_window_size=w).sliding_window_size == want


@pytest.mark.parametrize("w", [0, -2])
def test_window_zero_is_refused(w):
    with pytest.raises(ValueError, match="-1 \\(no window\\) or > 0"):
        RadixAttention(4, 8, 0.3, 2, 0, sliding_window_size=w)
    with pytest.raises(ValueError, match="-1 \\(no window\\) or > 0"):
        AttentionBackendConfig(device="cpu", dtype=torch.float32, attention_arch="mha", num_q_heads=4, num_kv_heads=2,
                               head_dim=8, v_head_dim=8, layer_windows=(-1, w))


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_window_layer_without_metadata_is_a_clear_error(mode):
    """A layer whose window the config did not list: ValueError naming the layer and the
    windows the backend knows (not an AttributeError deep in the kernel call)."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    ext = [1, 1] if mode == ForwardMode.DECODE else [4, 3]
    case = make_batch(mode, [5, 9], ext, 4, 2, 8, 1, window=3, seed=2, device=DEVICE)
    backend = TritonAttnBackend(AttentionBackendConfig.from_pools(case.fb.req_to_token_pool, case.pool, 4,
                                                                  layer_windows=(-1,)))
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    with pytest.raises(ValueError, match="layer 0 has sliding window 3 but the attention backend was built for "
                                         "windows \\[none\\]"):
        case.layer(case.q.reshape(case.q.shape[0], -1), case.k.reshape(case.k.shape[0], -1),
                   case.v.reshape(case.v.shape[0], -1), case.fb)


def test_config_refuses_a_pool_of_another_shape():
    case = make_batch(ForwardMode.DECODE, [3], [1], 4, 2, 8, 1, seed=3)
    cfg = backend_config(case)
    with pytest.raises(ValueError, match="does not match the backend config"):
        AttentionBackendConfig(**{**{f: getattr(cfg, f) for f in ("device", "dtype", "attention_arch", "num_q_heads",
                                                                  "head_dim", "v_head_dim", "layer_windows")},
                                  "num_kv_heads": 4}).with_pools(case.fb.req_to_token_pool, case.pool)


def test_attention_layer_never_sees_the_model_runner():
    """Backends are built from the config: nothing under attention/ names the model runner
    or probes an object with ``getattr(obj, name, default)``."""
    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "attnserve" / "attention"
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        if "model_runner" in text or re.search(r"getattr\([^)]*,[^)]*,", text):
            offenders.append(path.name)
    assert offenders == [], offenders


def test_model_runner_hands_windows_and_limits_to_the_backend():
    """The engine's config: per-layer windows from the model's layers (Gemma 3 tiny shape:
    local and global layers), limits from the flags."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model

    args = ServerArgs(model="gemma3-270m", load_format="dummy", device="cpu", max_total_tokens=256,
                      max_running_requests=3, context_length=64, triton_attention_num_kv_splits=7,
                      triton_attention_split_tile_size=64)
    loaded = load_model(args.model, load_format="dummy", device="cpu", load_tokenizer=False, progress=False)
    runner = ModelRunner(args, loaded)
    cfg = runner.attn_backend_config
    mc = loaded.model_config
    assert cfg.layer_windows == tuple(mc.sliding_window_size if s else -1 for s in mc.is_sliding_layer)
    assert cfg.window_sizes == (mc.sliding_window_size,) and -1 in cfg.layer_windows
    assert (cfg.max_batch_size, cfg.num_kv_splits, cfg.split_tile_size) == (3, 7, 64)
    assert cfg.token_to_kv_pool is runner.token_to_kv_pool and cfg.max_total_num_tokens == 256
    assert runner.attn_workspace_bytes == 0  # torch_native allocates nothing up front
    assert SimpleNamespace(**vars(runner.attn_backend)).config is cfg
