"""What a stream has trained, and what is left of it: resume at another data-parallel size.

A rank's ``Position`` resumes its own stream exactly, but the streams are dealt by DP rank, so a
position means nothing at another DP size. What does carry over is the set of samples trained so
far, by epoch. Each client records the samples of every micro-batch it returned
(``TrainedSamples``: one bitmap an epoch over the plan's sample ordinals, about 1 MB per 8M
samples); a resume at another DP size unites the saved ranks' records into a ``remainder``:

    {"first_epoch": E, "trained": {epoch: bitmap, ...}}

and the plan (``EpochPlan``) starts the new stream at epoch E, dealing each epoch's items over the
new DP size with the samples already trained left out. Every remaining sample of an epoch under
way is then trained exactly once and none is repeated; what cannot carry over is which samples
share a row (packing starts afresh) and the order within the rest of the epoch.

Records older than ``KEPT_EPOCHS`` before the oldest epoch a rank may still have a sample in flight
of (``Position.oldest``) are dropped when it saves: an epoch that far back counts as done.
"""
from __future__ import annotations

import base64
import zlib

import numpy as np

KEPT_EPOCHS = 2


class TrainedSamples:
    """The samples trained, by epoch: ``add`` each returned micro-batch's marks, ``to_state`` for a
    checkpoint, ``from_state`` to go on."""

    def __init__(self, bits: dict[int, np.ndarray] | None = None):
        self._bits: dict[int, np.ndarray] = dict(bits or {})

    def add(self, epochs, ordinals) -> None:
        if epochs is None or ordinals is None:
            return
        epochs, ordinals = np.asarray(epochs, np.int64), np.asarray(ordinals, np.int64)
        keep = ordinals >= 0
        for e in np.unique(epochs[keep]).tolist():
            at = ordinals[keep & (epochs == e)]
            bits = self._bits.get(e, np.zeros(0, bool))
            if at.max() >= len(bits):  # grows by doubling: ordinals arrive in no order
                bits = np.concatenate([bits, np.zeros(max(int(at.max()) + 1, 2 * len(bits)) - len(bits), bool)])
            bits[at] = True
            self._bits[e] = bits

    def epochs(self) -> list[int]:
        return sorted(self._bits)

    def count(self, epoch: int) -> int:
        return int(self._bits[epoch].sum()) if epoch in self._bits else 0

    def trained(self, epoch: int, ordinal: int) -> bool:
        bits = self._bits.get(epoch)
        return bits is not None and ordinal < len(bits) and bool(bits[ordinal])

    def union(self, other: "TrainedSamples") -> "TrainedSamples":
        out = TrainedSamples({e: b.copy() for e, b in self._bits.items()})
        for e, bits in other._bits.items():
            out.add(np.full(int(bits.sum()), e), np.flatnonzero(bits))
        return out

    def since(self, epoch: int) -> "TrainedSamples":
        return TrainedSamples({e: b for e, b in self._bits.items() if e >= epoch})

    def to_state(self) -> dict[str, str]:
        """JSON-ready: epoch -> base64 of the zlib-compressed bitmap."""
        return {str(e): base64.b64encode(zlib.compress(np.packbits(b).tobytes() + len(b).to_bytes(8, "little"))
                                         ).decode() for e, b in sorted(self._bits.items())}

    @classmethod
    def from_state(cls, state: dict[str, str] | None) -> "TrainedSamples":
        bits = {}
        for e, text in (state or {}).items():
            raw = zlib.decompress(base64.b64decode(text))
            n = int.from_bytes(raw[-8:], "little")
            bits[int(e)] = np.unpackbits(np.frombuffer(raw[:-8], np.uint8))[:n].astype(bool)
        return cls(bits)


def remainder_after(states: list[dict], previous: dict | None = None) -> dict:
    """The remainder to resume from, given every DP rank's saved loader state (``DataClient.save_state``)
    and the remainder the saved stream itself started from, if any."""
    if not states:
        raise ValueError("no loader states to resume from")
    trained = TrainedSamples.from_state((previous or {}).get("trained"))
    for s in states:
        if "trained" not in s:
            raise ValueError("a loader state without its record of trained samples cannot resume at another "
                             "data-parallel size; resume at the DP size it was saved at")
        trained = trained.union(TrainedSamples.from_state(s["trained"]))
    # A sample of an epoch older than a rank's position can still be in flight (blocks span epochs,
    # rows wait for the next block): the state names the oldest (``oldest``).
    first = max(min(min(s["epoch"], s.get("oldest", s["epoch"])) for s in states) - 1,
                (previous or {}).get("first_epoch", 0), 0)
    return {"first_epoch": first, "trained": trained.since(first).to_state()}
