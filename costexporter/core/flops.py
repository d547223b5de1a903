"""What MFU is computed from (docs/accounting.md, goodput): the trainer's model FLOPs per token
and the peak FLOPS of its GPUs for its dtype.

The peaks are data (`data/peak_flops.json`, each model's row with its datasheet), matched to a
device name as the profiles' power limits are. The trainer's keys are data, not money: any
trainer may post them. They are read with the same bounds as every other number it posts."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from costexporter.core.events import bounded_number
from costexporter.core.goodput import NO_FLOPS, Work
from costexporter.core.profiles import model_key

# Training FLOPs per parameter and token: the forward pass 2N, the backward 4N (Kaplan et al.
# 2020, "Scaling Laws for Neural Language Models", 2.1; the PaLM paper's appendix B). Attention's
# own FLOPs are left out: post `model_flops_per_token` to count them.
FLOPS_PER_PARAM_TOKEN = 6
# Far above any model (a 10T-parameter model is 6e13 FLOPs a token): a bound against junk.
MAX_FLOPS = 1e18
DTYPES = ("bf16", "fp16", "fp8", "tf32")
DEFAULT_DTYPE = "bf16"
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8", "tensorfloat32": "tf32"}


@functools.cache
def peak_table() -> dict[str, dict[str, Any]]:
    """Model key -> {dtype: dense peak TFLOPS, "source": its datasheet}."""
    text = resources.files("costexporter.core").joinpath("data/peak_flops.json").read_text()
    models: dict[str, dict[str, Any]] = json.loads(text)["models"]
    return models


def peak_flops(gpu_model: str | None, dtype: str) -> float | None:
    """One GPU's dense peak FLOPS for `dtype`, or None where the table has no row for it."""
    key = model_key(gpu_model) if gpu_model else None
    row = peak_table().get(key) if key else None
    tflops = row.get(dtype) if row else None
    return None if tflops is None else float(tflops) * 1e12


def dtype_of(meta: Mapping[str, Any]) -> str | None:
    """The trainer's `dtype` (default bf16), as a key of the table; None when it names another."""
    raw = meta.get("dtype")
    if raw is None or raw == "":
        return DEFAULT_DTYPE
    d = str(raw).strip().lower().replace("torch.", "")
    d = _ALIASES.get(d, d)
    return d if d in DTYPES else None


def flops_per_token(meta: Mapping[str, Any]) -> float | None:
    """`model_flops_per_token` as posted, else 6 x `model_params`; None without either (or
    with a value that is not a positive number)."""
    direct = bounded_number(meta.get("model_flops_per_token"), 0, MAX_FLOPS, above=True)
    if direct is not None:
        return float(direct)
    params = bounded_number(meta.get("model_params"), 0, MAX_FLOPS / FLOPS_PER_PARAM_TOKEN, above=True)
    if params is not None:
        return FLOPS_PER_PARAM_TOKEN * float(params)
    return None


def work(meta: Mapping[str, Any], gpu_model: str | None, tokens: int) -> Work:
    """The program layer's inputs for a job, with the reason where one is missing."""
    per_token = flops_per_token(meta)
    dtype = dtype_of(meta)
    peak = peak_flops(gpu_model, dtype) if dtype else None
    why = []
    if per_token is None:
        why.append(NO_FLOPS)
    if dtype is None:
        why.append(f"program: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    elif peak is None:
        why.append(f"program: no peak {dtype} FLOPS known for GPU model {gpu_model or '(unknown)'}")
    if tokens <= 0 and per_token is not None:
        why.append("program: the job's steps post no tokens")
    return Work(tokens, per_token, peak, tuple(why))
