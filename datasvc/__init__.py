"""vlmfeed's data service: packed vision-language micro-batches for each data-parallel rank.

The public API (everything else in ``datasvc`` is internal and may change)::

    from datasvc import DataService, for_training, connect

    connect()                                        # join RAY_ADDRESS, or start a local Ray
    cfg = for_training("shards/*.tar", device="gpu", micro_batch_size=2, dp_size=world_size)
    service = DataService(cfg)                       # one feeder per DP rank
    for batch in service.client(dp_rank):            # TrainBatch: torch tensors; batch.as_dict() for a dict
        ...

``service.stats()`` is a ``ServiceStats``: every rank's report (accounting of each sample read,
time per stage, queue, actors) and their totals; ``.as_dict()`` gives its JSON form.

Without Ray, ``BlockProducer(cfg, dp_rank).micro_batches()`` yields the same ``PackedBatch``es in
this process (``batch_tensors`` makes each into the ``TrainBatch`` a client yields). In another
process of the same job (a torchrun rank), ``attach(cfg, dp_rank, run=...)`` takes the stream of a
service started elsewhere.

Names are resolved on first use, so ``import datasvc`` does not import Ray or torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ServiceConfig": "datasvc.config",
    "DecodeConfig": "datasvc.config",
    "PoolConfig": "datasvc.config",
    "BudgetConfig": "datasvc.config",
    "BalanceConfig": "datasvc.config",
    "for_training": "datasvc.training",
    "training_config": "datasvc.training",
    "DataService": "datasvc.service.client",
    "DataClient": "datasvc.service.client",
    "ServiceStats": "datasvc.service.client",
    "attach": "datasvc.service.client",
    "batch_tensors": "datasvc.stream.tensors",
    "BlockProducer": "datasvc.stream.producer",
    "PackedBatch": "datasvc.batch",
    "TrainBatch": "datasvc.batch",
    "connect": "datasvc.service.cluster",
    "UserError": "datasvc.usage",
    "DataServiceError": "datasvc.stream.producer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'datasvc' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
