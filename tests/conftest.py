import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def photo_shards(tmp_path_factory):
    from datasvc.samples import write_photo_shards

    return write_photo_shards(str(tmp_path_factory.mktemp("photos")), samples_per_shard=6, copies=2)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from datasvc.service.cluster import connect

    connect(num_cpus=2, object_store_memory=400 * 1024 * 1024)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def qwen3vl():
    from datasvc.registry import get_pipeline

    return get_pipeline("qwen3vl", max_pixels=1024 * 1024)


@pytest.fixture(scope="session")
def cpu_decoder():
    from datasvc.media.decode import CpuDecoder

    return CpuDecoder(num_threads=1)
