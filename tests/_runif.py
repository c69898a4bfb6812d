"""One helper to mark tests that need hardware, like Lightning's ``RunIf``."""

from __future__ import annotations

import pytest
import torch


def run_if(*, min_cuda_gpus: int = 0) -> pytest.MarkDecorator:
    """Skip unless at least ``min_cuda_gpus`` CUDA GPUs are present.

    Example:
        @run_if(min_cuda_gpus=1)
        def test_on_gpu(): ...
    """
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = f"needs {min_cuda_gpus} CUDA GPU(s), found {have}"
    mark = pytest.mark.cuda if min_cuda_gpus <= 1 else pytest.mark.multigpu
    skip = pytest.mark.skipif(have < min_cuda_gpus, reason=reason)

    def combine(obj: object) -> object:
        return mark(skip(obj))

    return combine  # type: ignore[return-value]
