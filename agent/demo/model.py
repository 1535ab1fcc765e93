"""The demo's small real torch model and the fault it can be told to inject.

Owns :class:`TinyLMConfig`, :class:`TinyLM` (a decoder-only transformer with random weights) and
:func:`_injected_hang_in_forward`, the deliberately hung frame the demo shows in py-spy's output.
Imports torch and pydantic only; it runs inside the scheduler subprocesses, never in the agent.

The model is real (embedding, causal self-attention blocks, MLP, LM head, greedy decoding) but
small enough that one decode step for a batch of a few requests costs about a millisecond of one
CPU core. There is no KV cache: each step re-reads the last ``window`` tokens of every request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from pydantic import BaseModel, Field
from torch import nn
from torch.nn import functional as F

__all__ = ["PAD_ID", "HangFault", "TinyLM", "TinyLMConfig"]

#: Token id used to left-pad short contexts (byte 0 never appears in UTF-8 text).
PAD_ID = 0


class TinyLMConfig(BaseModel):
    """Shape of the demo model; every rank builds identical weights from ``seed``.

    Attributes:
        vocab_size: tokens in the vocabulary (byte-level prompts use ids 0..255).
        hidden_size: width of the residual stream.
        num_layers: transformer blocks.
        num_heads: attention heads per block (must divide ``hidden_size``).
        window: context tokens fed to each decode step (no KV cache).
        seed: torch RNG seed for the random weights.
    """

    vocab_size: int = Field(default=1024, ge=256, le=65536)
    hidden_size: int = Field(default=128, ge=8, le=4096)
    num_layers: int = Field(default=2, ge=1, le=64)
    num_heads: int = Field(default=4, ge=1, le=64)
    window: int = Field(default=16, ge=1, le=4096)
    seed: int = 0


def _injected_hang_in_forward(seconds: float | None, keep_waiting: Callable[[], bool]) -> None:
    """Hang the forward pass on purpose: the demo's injected fault.

    Its distinctive name is what py-spy shows at the top of the hung scheduler's stack.

    Args:
        seconds: how long to hang, in seconds; ``None`` hangs until ``keep_waiting`` says stop.
        keep_waiting: polled every 0.1 s; returning False ends the hang early (the scheduler
            passes "my parent is still alive", so an orphaned scheduler never hangs forever).
    """
    deadline = None if seconds is None else time.monotonic() + seconds
    while keep_waiting():
        if deadline is None:
            time.sleep(0.1)
            continue
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return
        time.sleep(min(0.1, left_s))


class HangFault:
    """A one-shot hang armed by ``POST /debug/hang`` and fired by the next forward.

    Args:
        keep_waiting: see :func:`_injected_hang_in_forward`.
    """

    def __init__(self, keep_waiting: Callable[[], bool]) -> None:
        self._keep_waiting = keep_waiting
        self._armed = False
        self._seconds: float | None = None

    def arm(self, seconds: float | None) -> None:
        """Make the next forward hang for ``seconds`` (``None``: until the parent dies)."""
        self._seconds = seconds
        self._armed = True

    @property
    def armed(self) -> bool:
        return self._armed

    def fire_if_armed(self) -> None:
        """Called from inside the forward pass; hangs once, then disarms."""
        if self._armed:
            self._armed = False
            _injected_hang_in_forward(self._seconds, self._keep_waiting)


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.up = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.down = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        shape = (b, t, self.num_heads, h // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """Decoder-only transformer with random weights (deterministic per ``cfg.seed``).

    Args:
        cfg: model shape.
        fault: the injectable hang; ``None`` for a model that never hangs.
    """

    def __init__(self, cfg: TinyLMConfig, fault: HangFault | None = None) -> None:
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}")
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.fault = fault
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Parameter(torch.randn(cfg.window, cfg.hidden_size) / math.sqrt(cfg.hidden_size))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the next token of every sequence.

        Args:
            input_ids: int64 tensor ``[batch, window]``, left-padded with :data:`PAD_ID`.

        Returns:
            float tensor ``[batch, vocab_size]``.
        """
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and self.fault is not None:
                self.fault.fire_if_armed()
        return self.lm_head(self.ln_f(x[:, -1, :]))

    def context(self, tokens: list[int]) -> list[int]:
        """The last ``window`` tokens of a sequence, left-padded to exactly ``window``."""
        w = self.cfg.window
        tail = [t % self.cfg.vocab_size for t in tokens[-w:]]
        return [PAD_ID] * (w - len(tail)) + tail

    @torch.inference_mode()
    def decode_step(self, contexts: list[list[int]]) -> list[int]:
        """One greedy decode step for a batch.

        Args:
            contexts: per request, exactly ``window`` token ids (see :meth:`context`).

        Returns:
            The next token id of each request.
        """
        ids = torch.tensor(contexts, dtype=torch.long)
        return self(ids).argmax(dim=-1).tolist()
