"""The steady-state window of a stream of micro-batches, shared by the profiler and the benches.

The service packs a block at a time, so micro-batches arrive in bursts, one burst per block, and
the arrival of a block's first micro-batch marks the end of that block's production. The first
block carries actor start-up (process spawn, DALI and tokenizer load), so the window opens at the
first micro-batch of the second block (index 1) and closes at the first micro-batch of the last
block whose micro-batches were all consumed; it holds the production of the blocks after the one
it opens on, up to and including the one it closes on.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    opens: int  # the block whose first micro-batch opens the window
    closes: int  # the block whose first micro-batch closes it

    @property
    def produced(self) -> range:
        """Indices of the blocks produced inside the window."""
        return range(self.opens + 1, self.closes + 1)


def steady_window(blocks_seen: int, ended: bool) -> Window | None:
    """The window over ``blocks_seen`` blocks; ``ended``: the stream ended, so the last block seen
    was consumed whole. None when too few blocks arrived for a window that skips start-up."""
    closes = blocks_seen - 1 if ended else blocks_seen - 2
    return Window(1, closes) if closes >= 2 else None


def window_is_full(blocks_seen: int, samples_done: int, seconds_done: float, samples: int | None,
                   seconds: float | None) -> bool:
    """Whether a stream that aims at ``samples`` or ``seconds`` inside the window can stop: at least
    two blocks produced inside it, and the target reached by the blocks already complete."""
    if blocks_seen < 4:
        return False
    return (samples is not None and samples_done >= samples) or (seconds is not None and seconds_done >= seconds)
