"""``vllm.v1.worker.gpu_model_runner`` as a test rank sees it (vLLM 0.32's module path, class and
method names): ``GPUModelRunner.capture_model()`` (called by the worker's
``compile_or_warm_up_model``) captures one CUDA graph per size before the engine's first step
(``_capture_cudagraphs`` -> ``_dummy_run``); each dummy run is the model's forward, whose
tensor-parallel all-reduce every rank must reach.

The hang of vLLM #17167: one worker never returns from its capture of a size (spinning in the
forward's compute, as a kernel that never finishes), the others wait for it in the captured
all-reduce. ``hang_size`` is the size whose capture hangs on this rank (``None``: none); the hang
lasts until ``deadline`` (``time.monotonic()``).
"""

from __future__ import annotations

import time
from typing import Any

#: The sizes captured, largest first (vLLM captures its ``cudagraph_capture_sizes`` in reverse).
CAPTURE_SIZES = (8, 4, 2, 1)


class GPUModelRunner:
    """Runs the model on one worker; captures its CUDA graphs at start-up."""

    def __init__(self, hidden_size: int = 32, *, hang_size: int | None = None, deadline: float = 0.0) -> None:
        self.hidden_size = hidden_size
        self.hang_size = hang_size
        self.deadline = deadline

    def capture_model(self) -> int:
        """Capture every size; returns the graphs' memory, bytes (vLLM's return value)."""
        self._capture_cudagraphs(CAPTURE_SIZES)
        return 0

    def _capture_cudagraphs(self, sizes: tuple[int, ...]) -> None:
        for num_tokens in sizes:
            self._dummy_run(num_tokens)

    def _dummy_run(self, num_tokens: int) -> Any:
        """The forward on dummy inputs: the layer's compute, then the tensor-parallel all-reduce."""
        import torch
        import torch.distributed as dist

        x = torch.ones(num_tokens, self.hidden_size)
        y = torch.tanh(x @ torch.ones(self.hidden_size, self.hidden_size) / self.hidden_size)
        if num_tokens == self.hang_size:
            self._kernel_never_finishes()
        dist.all_reduce(y)
        return y

    def _kernel_never_finishes(self) -> None:
        """The injected hang: compute that never completes (until the deadline)."""
        import torch

        m = torch.rand(192, 192)
        while time.monotonic() < self.deadline:
            chunk_end = time.monotonic() + 0.005
            while time.monotonic() < chunk_end:
                m = torch.tanh(m @ m)
            time.sleep(0.001)  # mostly compute, with room for the 2 shared cores of CI
