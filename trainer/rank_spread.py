"""Every data-parallel rank's seconds and vision patches of one step, and their straggler ratio
(max / mean seconds: the step waits for the slowest rank). Both trainer backends record it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from datasvc.pack.balance import straggler_ratio


@dataclass(frozen=True, slots=True)
class RankSpread:
    seconds: list[float]
    vision_patches: list[int]
    straggler_ratio: float | None  # None with one rank: nothing to wait for


def gather_rank_spread(seconds: float, vision_patches: int, group=None, device=None) -> RankSpread:
    """All ranks of ``group`` (the default group when None) call this together; with no process
    group, or a group of one, nothing is gathered."""
    mine = torch.tensor([seconds, float(vision_patches)], dtype=torch.float64, device=device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [mine]
    if world > 1:
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    secs = [round(s, 4) for s, _ in rows]
    return RankSpread(secs, [int(p) for _, p in rows], round(straggler_ratio(secs), 4) if world > 1 else None)
