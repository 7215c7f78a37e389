"""Test helper: torch tensors -> numpy with bf16 / float8 bits kept exact.

The references the tests compare against (compressed-tensors, transformers,
SpecForge) are torch libraries; the project itself reads and writes numpy and
never imports torch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Convert a CPU torch tensor to numpy, keeping bf16 / float8 bits exact.

    ``Tensor.numpy()`` refuses bf16 and float8; this views them as same-width
    integers and reinterprets the bits as the matching ml_dtypes type.
    """
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e5m2)
    return t.numpy()
