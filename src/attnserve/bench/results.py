"""Where benchmark results go: ``<out>/<device-slug>-<kind>-<date>.json``."""

from __future__ import annotations

import datetime as dt
import json
import os
import time

import torch


def device_slug(device: str) -> str:
    """File-name form of the device: ``"h100-80gb-hbm3"`` for CUDA, ``"cpu"`` otherwise."""
    if device == "cuda":
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    return "cpu"


def write_result(result: dict, out_dir: str, kind: str, device: str = "cuda") -> str:
    """Write ``result`` (which must hold ``"date"``) as indented JSON; print and return the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{device_slug(device)}-{kind}-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return path


def cuda_run_metadata(benchmark: str, t0: float) -> dict:
    """The fields a CUDA benchmark's result records about its run: ``benchmark`` (the kind),
    today's ``date``, the ``device`` slug and ``gpu`` name, the torch / triton / CUDA
    versions and ``total_s`` since ``t0`` (a `time.perf_counter` reading)."""
    import triton

    return {"benchmark": benchmark, "date": dt.date.today().isoformat(), "device": device_slug("cuda"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "total_s": time.perf_counter() - t0}
