"""The one map between dtype names (as specs, records and the wire use them) and torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_name"]

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; a dtype outside :data:`DTYPES` is named by ``str(dtype)``."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    return str(dtype)
