"""One retry backoff for every retrying loop: jittered exponential, and the server's word wins.

Owns :class:`Backoff`, used by the span processor's spool replay (:mod:`exporters.otlp.retry`),
``servewatch export`` (:mod:`exporters.otlp.replay`), the restart of a crashed watcher
(:mod:`agent.runtime.supervision`) and a job peer's retried report (:mod:`agent.fleet.peers`): after a failed attempt the next one waits
``initial_s`` doubling up to ``max_s``, each wait jittered by +-``jitter`` (so agents restarted
together do not retry together), as the OTLP exporters' retry does; when the collector said how
long to wait (HTTP ``Retry-After``, gRPC ``google.rpc.RetryInfo``: ``SendResult.retry_after_s``),
the wait is at least that. A success resets it.

Imports the standard library only.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Jittered exponential backoff that honours a server's retry delay. Not thread-safe (one
    retrying loop owns one).

    Args:
        initial_s: the first wait after a failure, seconds.
        max_s: the longest wait of the doubling, seconds (a server's retry delay may be longer).
        jitter: each wait is multiplied by a uniform factor in ``[1 - jitter, 1 + jitter]``.
        rng: the random source (tests).
    """

    def __init__(self, initial_s: float, max_s: float, *, jitter: float = 0.2, rng: random.Random | None = None) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._current_s = 0.0

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``initial_s`` again."""
        self._current_s = 0.0

    def next_delay_s(self, retry_after_s: float | None = None) -> float:
        """The wait after one more failed attempt, seconds.

        Args:
            retry_after_s: the wait the server asked for (``SendResult.retry_after_s``); the
                result is at least this long.
        """
        self._current_s = min(self.max_s, self._current_s * 2) if self._current_s else self.initial_s
        delay_s = self._current_s * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        if retry_after_s is not None:
            delay_s = max(delay_s, retry_after_s)
        return delay_s
