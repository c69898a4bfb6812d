"""One helper to mark tests that need hardware, like Lightning's ``RunIf``.

``conftest.py`` skips the marked tests on a machine without the hardware.
"""

from __future__ import annotations

import pytest


def run_if(*, min_cuda_gpus: int = 1) -> pytest.MarkDecorator:
    """A mark that skips the test unless ``min_cuda_gpus`` CUDA GPUs are present.

    Works on a function or as a module's ``pytestmark``.

    Example:
        @run_if(min_cuda_gpus=1)
        def test_on_gpu(): ...
    """
    return pytest.mark.multigpu if min_cuda_gpus > 1 else pytest.mark.cuda
