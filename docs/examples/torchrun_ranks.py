"""Each torchrun process trains on its data-parallel rank's stream of one vlmfeed service.

    ray start --head --node-ip-address 127.0.0.1     # or any Ray cluster: RAY_ADDRESS names it
    RAY_ADDRESS=127.0.0.1:6379 torchrun --nproc-per-node 8 docs/examples/torchrun_ranks.py 'shards/*.tar'

Process 0 starts the service (one feeder per DP rank, on the cluster) and keeps it alive until every
rank is done; every process joins the same Ray cluster and namespace and attaches to its own rank's
feeder. Here every process is one DP rank; with tensor or pipeline parallelism, give the ranks of one
replica the same ``dp_rank`` and a ``consumer`` index each (``cfg.consumers_per_replica``).
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from datasvc import DataService, attach, connect, for_training

STEPS = int(os.environ.get("STEPS", "3"))


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    run = f"torchrun-{os.environ['MASTER_ADDR']}-{os.environ['MASTER_PORT']}"  # the same in every process
    connect()  # RAY_ADDRESS's cluster, in vlmfeed's namespace
    cfg = for_training(sys.argv[1:], device="cpu", micro_batch_size=1, dp_size=world)
    service = DataService(cfg, run=run) if rank == 0 else None
    dist.barrier()  # the feeders exist
    client = attach(cfg, dp_rank=rank, run=run)
    for step, batch in zip(range(STEPS), client):
        # batch is a TrainBatch: model(batch.tokens, ...); loss.backward(); optimizer.step() ... (every rank
        # the same number of steps)
        print(json.dumps({"rank": rank, "step": step, "keys": batch.sample_keys, "epochs": batch.sample_epochs,
                          "tokens": list(batch.tokens.shape)}), flush=True)
    client.close()
    dist.barrier()  # every rank is done with its feeder
    if service is not None:
        service.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
