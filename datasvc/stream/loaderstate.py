"""A rank's loader state: what a checkpoint keeps of the data stream, typed; a dict only where a
checkpoint stores it (``as_dict``/``from_dict``: the saved form, one flat mapping, as Bridge's
checkpoints and the CPU backend's hold it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from datasvc.pack.epoch import Position
from datasvc.remainder import KEPT_EPOCHS, TrainedSamples


@dataclass(frozen=True, slots=True)
class LoaderState:
    """Where rank ``dp_rank``'s stream continues (``position``: the next micro-batch), checked on
    restore against the data config (``fingerprint``) and the shard files (``dataset``); ``trained``:
    the samples trained so far (what a resume at another DP size deals anew); ``remainder``: the
    origin of a stream that was itself dealt anew, so the next resume rebuilds the same plan."""

    fingerprint: str
    dp_rank: int
    position: Position
    trained: TrainedSamples = field(default_factory=TrainedSamples)
    dataset: dict | None = None
    remainder: dict | None = None

    def as_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "dp_rank": self.dp_rank, **self.position.as_dict(),
                **({"dataset": self.dataset} if self.dataset is not None else {}),
                "trained": self.trained.to_state(),
                **({"remainder": self.remainder} if self.remainder else {})}

    @classmethod
    def after(cls, delivered: dict | None, fingerprint: str, dp_rank: int, trained: TrainedSamples,
              dataset: dict | None = None, remainder: dict | None = None) -> "LoaderState":
        """The state that resumes right after the micro-batch at position ``delivered`` (None: from the
        start), keeping the trained samples of the epochs a resume at another DP size still deals."""
        after = Position.from_dict(delivered).moved(1) if delivered else Position()
        return cls(fingerprint, dp_rank, after, trained.since(after.in_flight_from - KEPT_EPOCHS), dataset, remainder)

    @classmethod
    def from_dict(cls, d: dict) -> "LoaderState":
        """The saved form back (states saved before a field existed leave it empty)."""
        return cls(d.get("fingerprint", ""), d.get("dp_rank", -1), Position.from_dict(d),
                   TrainedSamples.from_state(d.get("trained")), d.get("dataset"), d.get("remainder"))

    @property
    def last_delivered(self) -> dict:
        """The position of the micro-batch before ``position`` (the last one trained), as a client
        reports ``last_position``."""
        return self.position.moved(-1).as_dict()
