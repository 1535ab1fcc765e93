"""``sglang.srt.model_executor.runner.decode_cuda_graph_runner`` as a test rank sees it (SGLang
0.5.23's module path, class and method names): ``DecodeCudaGraphRunner.capture()`` captures one
CUDA graph per batch size before the server's first step; each capture runs the model's forward
once (``capture_one_shape`` -> ``run_once``), whose tensor-parallel all-reduce every rank must
reach.

The hang of SGLang #3547 (vLLM #17167 is the same shape in ``capture_model``): one rank never
returns from its capture of a batch size (spinning in the forward's compute, as a kernel that never
finishes), the others wait for it in the captured all-reduce. ``hang_bs`` is the batch size whose
capture hangs on this rank (``None``: none); the hang lasts until ``deadline`` (``time.monotonic()``).
"""

from __future__ import annotations

import time
from typing import Any

#: The batch sizes captured, smallest first (SGLang captures 1, 2, 4, 8, then steps of 8).
CAPTURE_BS = (1, 2, 4, 8)


class DecodeCudaGraphRunner:
    """Captures and replays the decode forward as CUDA graphs (one per batch size)."""

    def __init__(self, hidden_size: int = 32, *, hang_bs: int | None = None, deadline: float = 0.0) -> None:
        self.hidden_size = hidden_size
        self.hang_bs = hang_bs
        self.deadline = deadline
        self.graphs: dict[int, Any] = {}

    def capture(self) -> None:
        """Capture every batch size (SGLang: ``with self.model_context(): self._capture()``)."""
        self._capture()

    def _capture(self) -> None:
        for bs in CAPTURE_BS:
            self.graphs[bs] = self.capture_one_shape(bs, self._forward)

    def capture_one_shape(self, size: int, forward: Any) -> Any:
        """Capture the forward of batch size ``size``: run it once inside the graph capture."""
        import torch

        x = torch.ones(size, self.hidden_size)

        def run_once() -> Any:
            return forward(x, size)

        return run_once()

    def _forward(self, x: Any, size: int) -> Any:
        """The decode forward: the layer's compute, then the tensor-parallel all-reduce."""
        import torch
        import torch.distributed as dist

        y = torch.tanh(x @ torch.ones(self.hidden_size, self.hidden_size) / self.hidden_size)
        if size == self.hang_bs:
            self._kernel_never_finishes(y)
        dist.all_reduce(y)
        return y

    def _kernel_never_finishes(self, y: Any) -> None:
        """The injected hang: compute that never completes (until the deadline)."""
        import torch

        m = torch.rand(192, 192)
        while time.monotonic() < self.deadline:
            chunk_end = time.monotonic() + 0.005
            while time.monotonic() < chunk_end:
                m = torch.tanh(m @ m)
            time.sleep(0.001)  # mostly compute, with room for the 2 shared cores of CI
