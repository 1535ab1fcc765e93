"""``deep_ep.buffer.Buffer`` as a test rank sees it: ``dispatch`` and ``combine`` wait, spinning on
the host, until every rank of the expert-parallel group has arrived, with no torch.distributed call
(as DeepEP's own dispatch spins on a receive counter written by its peers: SGLang #26482).

The shared flag is a file per rank and call in ``$DEEP_EP_STANDIN_FLAGS`` (a folder the ranks
share); the wait gives up after ``$DEEP_EP_STANDIN_TIMEOUT_S`` (default 90) seconds with DeepEP's
own words.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class Buffer:
    """The expert-parallel communication buffer of one rank (``Buffer(group, num_nvl_bytes, ...)``)."""

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **_: Any) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.flags = Path(os.environ["DEEP_EP_STANDIN_FLAGS"])
        self.flags.mkdir(parents=True, exist_ok=True)
        self.calls = 0

    def _arrive_and_spin(self, what: str) -> None:
        """Mark this rank arrived, then spin until every rank of the group has (bounded)."""
        self.calls += 1
        tag = f"{what}-{self.calls}"
        (self.flags / f"{tag}-rank{self.rank}").touch()
        deadline = time.monotonic() + float(os.environ.get("DEEP_EP_STANDIN_TIMEOUT_S", "90"))
        while not all((self.flags / f"{tag}-rank{r}").exists() for r in range(self.group_size)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"DeepEP error: timeout ({what} receivers)")
            spin_end = time.monotonic() + 0.002
            while time.monotonic() < spin_end:  # the host-side spin on the counter
                pass
            time.sleep(0.001)  # room for the 2 shared cores of CI

    def dispatch(self, x: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Send tokens to their experts' ranks: waits for every rank of the group."""
        self._arrive_and_spin("dispatch")
        return (x, None, None, None, None, None)

    def combine(self, x: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Bring the experts' outputs back: waits for every rank of the group."""
        self._arrive_and_spin("combine")
        return (x, None, None)
