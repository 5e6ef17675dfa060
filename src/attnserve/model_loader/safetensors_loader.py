"""HF checkpoint directories: ``config.json`` plus ``*.safetensors`` shards."""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator, List, Tuple

import torch


def load_hf_config(model_dir: str) -> Any:
    """HF config from ``model_dir/config.json`` via ``transformers.AutoConfig``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def safetensors_files(model_dir: str) -> List[str]:
    """Sorted ``*.safetensors`` files of ``model_dir``.

    Raises:
        FileNotFoundError: when there are none.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    return files


def iterate_safetensors_weights(model_dir: str, progress: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, CPU tensor)`` for every tensor of every shard, in the stored dtype.

    Tensors are read one at a time with ``safetensors.safe_open`` (memory-mapped), with a
    tqdm bar over shards.

    Raises:
        FileNotFoundError: when the directory holds no ``*.safetensors``.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    for path in tqdm(safetensors_files(model_dir), desc="Loading safetensors shards", disable=not progress, unit="file"):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
