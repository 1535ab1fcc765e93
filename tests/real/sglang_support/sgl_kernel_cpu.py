"""``sgl_kernel`` for the real-SGLang test server: a pure-torch stand-in for SGLang's CPU kernels.

The one deviation of ``tests/real/install_sglang.py`` from a stock SGLang 0.5.23 install. PyPI's
``sgl-kernel`` / ``sglang-kernel`` wheels are CUDA builds (their import needs ``libnvrtc.so.12``),
and SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a few ``*_cpu`` helpers from
``sgl_kernel`` when its modules load. On a CPU without AMX SGLang itself bypasses every CPU kernel
but one on the plain serving path: ``assign_req_to_token_pool_cpu`` (write a batch's KV-cache slot
indices into the request-to-token table), written here in plain torch. Any other kernel name
resolves to a function that raises ``NotImplementedError`` naming it, so a code path that would
need a real kernel fails loudly instead of computing something else.

Installed as package ``sgl_kernel`` (``__init__.py``) of distribution ``sgl-kernel
0.0.0+servewatch.cpu``.
"""

from __future__ import annotations

from typing import Any

import torch

__version__ = "0.0.0+servewatch.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request ``i`` of the batch, ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` takes
    the next ``end[i] - start[i]`` entries of ``out_cache_loc`` (the requests' new slots, in order)."""
    taken = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel (servewatch CPU stand-in): kernel {name!r} is not available")

    missing.__name__ = name
    return missing
