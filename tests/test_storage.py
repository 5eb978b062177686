"""Shards on an S3-compatible server (moto's, started on 127.0.0.1 behind a proxy that can cut a
response mid-body): listed, indexed and read by ranged GETs exactly as the local files are, a
dropped connection retried and counted, a dead one costing its samples alone."""
import io
import os
import re
import socket
import threading

import numpy as np
import pytest
from PIL import Image

from datasvc.read import storage
from datasvc.read.shards import NoShardsError, ReadLimits, expand_shards, index_shard, read_samples
from datasvc.samples import write_photo_shards
from datasvc.stream.process import process_item
from datasvc.wire import WorkItem

moto_server = pytest.importorskip("moto.server")
BUCKET = "vlmfeed-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CuttingProxy:
    """TCP proxy to the S3 server: logs each request's method and whether it asked for a byte range,
    and, while ``cuts`` > 0, closes a connection once it has passed ``cut_after`` response bytes."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.cuts, self.cut_after = 0, 1 << 20  # past the small reads: cuts a 2 MB image mid-body
        self.requests: list[tuple[str, bool]] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client), daemon=True).start()

    def _requests(self, src, dst):
        try:
            while data := src.recv(1 << 16):
                text = data.decode("latin-1")
                for m in re.finditer(r"(GET|HEAD|PUT|POST) \S+ HTTP/1\.[01]\r\n(.*?)\r\n\r\n", text, re.S):
                    with self._lock:
                        self.requests.append((m.group(1), "\r\nrange:" in "\r\n" + m.group(2).lower()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # shutdown first: a thread blocked in recv() keeps a closed socket open
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _responses(self, src, dst):
        sent, armed = 0, False
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    if self.cuts > 0 and not armed:
                        armed, sent = True, 0
                if armed and sent + len(data) > self.cut_after:
                    dst.sendall(data[:self.cut_after - sent])
                    with self._lock:
                        self.cuts -= 1
                    break
                sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # shutdown first: a thread blocked in recv() keeps a closed socket open
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self):
        self._server.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import boto3
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    proxy = CuttingProxy(server._port)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    local = tmp_path_factory.mktemp("s3-local")
    paths = write_photo_shards(str(local), samples_per_shard=6, copies=1)
    big = str(local / "big-000000.tar")
    _write_big_shard(big)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server._port}")
    client.create_bucket(Bucket=BUCKET)
    for p in paths + [big]:
        client.upload_file(p, BUCKET, f"shards/{os.path.basename(p)}")
    yield {"local": paths, "big": big, "proxy": proxy}
    proxy.close()
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _write_big_shard(path):
    """Four samples whose images are ~2 MB each (noise does not compress), so one GET per image."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    with wds.TarWriter(path) as sink:
        for i in range(4):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (820, 820, 3), dtype=np.uint8)).save(buf, "PNG")
            sink.write({"__key__": f"noise{i}", "png": buf.getvalue(), "txt": f"noise number {i}"})


def url(local_path):
    return f"s3://{BUCKET}/shards/{os.path.basename(local_path)}"


def test_listing_by_glob_and_braces(s3):
    names = [os.path.basename(p) for p in s3["local"]]
    assert expand_shards([f"s3://{BUCKET}/shards/photos-*.tar"]) == [url(p) for p in sorted(s3["local"])]
    n = len(names) - 1
    assert expand_shards([f"s3://{BUCKET}/shards/photos-{{000000..{n:06d}}}.tar"]) == sorted(url(p) for p in s3["local"])
    with pytest.raises(NoShardsError, match="no such object"):
        expand_shards([url(s3["local"][0]), f"s3://{BUCKET}/shards/missing.tar"])


def test_a_bucket_folder_is_its_tars(s3):
    assert expand_shards([f"s3://{BUCKET}/shards/"]) == sorted(url(p) for p in s3["local"] + [s3["big"]])


@pytest.mark.parametrize("pattern", [f"s3://{BUCKET}/shards/photos-000000.tar", f"s3://{BUCKET}/shards/*.tar"])
def test_missing_or_refused_credentials_are_named_at_once(s3, monkeypatch, pattern):
    import s3fs

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    before = storage.counters()
    try:
        with pytest.raises(storage.StoreError, match="no credentials for the store.*AWS_ACCESS_KEY_ID"):
            expand_shards([pattern])
        assert storage.counters()["retries"] == before["retries"]  # nothing a retry could fix
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("answers", [False, True], ids=["refuses", "never-answers"])
def test_an_unreachable_endpoint_is_named_not_taken_for_a_missing_file(monkeypatch, answers):
    import s3fs

    listener = socket.create_server(("127.0.0.1", 0))  # accepts (in its backlog) and never answers
    port = listener.getsockname()[1] if answers else free_port()
    if not answers:
        listener.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for key, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "READ_TIMEOUT_S", 1)
    monkeypatch.setattr(storage, "CONNECT_TIMEOUT_S", 1)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(storage.StoreError, match=rf"http://127.0.0.1:{port} is unreachable"):
            expand_shards(["s3://bucket/x/00000.tar"])
    finally:
        listener.close()
        s3fs.S3FileSystem.clear_instance_cache()


def test_an_unknown_url_scheme_is_named(tmp_path):
    with pytest.raises(storage.StoreError, match="cannot read nosuchfs:// URLs"):
        expand_shards(["nosuchfs://bucket/x.tar"])


def test_remote_shards_index_and_encode_as_local_ones(s3, qwen3vl, cpu_decoder):
    for local in s3["local"][:2]:
        here, there = index_shard(local), index_shard(url(local))
        assert there.samples == here.samples and not there.truncated
        a = process_item(WorkItem(local, 0, tuple(here.samples)), qwen3vl, cpu_decoder)
        b = process_item(WorkItem(url(local), 0, tuple(there.samples)), qwen3vl, cpu_decoder)
        assert [s.key for s in a.samples] == [s.key for s in b.samples] and a.samples
        assert all(np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.pixels, y.pixels)
                   for x, y in zip(a.samples, b.samples))


def test_reads_are_ranged_not_whole_objects(s3):
    proxy, big = s3["proxy"], s3["big"]
    idx = index_shard(url(big))
    before, logged = storage.counters(), len(proxy.requests)
    (raw,) = read_samples(url(big), [idx.samples[2]], ReadLimits())
    fetched = storage.counters()["bytes"] - before["bytes"]
    size = os.path.getsize(big)
    image_bytes = next(m.size for m in idx.samples[2].members if m.ext == "png")
    assert len(raw.images[0][1]) == image_bytes and raw.text == "noise number 2"
    assert image_bytes <= fetched <= image_bytes + 2 * storage.WINDOW < size / 3  # the magic peek, the caption
    gets = [ranged for method, ranged in proxy.requests[logged:] if method == "GET"]
    assert gets and all(gets)


def test_a_dropped_connection_is_retried_and_counted(s3):
    proxy, big = s3["proxy"], s3["big"]
    idx = index_shard(url(big))
    expected = list(read_samples(big, idx.samples, ReadLimits()))
    before = storage.counters()
    proxy.cuts = 1
    got = list(read_samples(url(big), idx.samples, ReadLimits()))
    assert proxy.cuts == 0
    assert storage.counters()["retries"] == before["retries"] + 1
    assert [r.images for r in got] == [r.images for r in expected] and not any(r.problem for r in got)


def test_a_connection_that_keeps_dropping_costs_its_samples_only(s3):
    proxy, big = s3["proxy"], s3["big"]
    idx = index_shard(url(big))
    before = storage.counters()
    proxy.cuts = storage.ATTEMPTS
    got = list(read_samples(url(big), idx.samples, ReadLimits()))
    proxy.cuts = 0
    assert storage.counters()["failures"] >= before["failures"] + 1
    assert got[0].problem and all(not r.problem for r in got[1:])


def test_reading_a_whole_shard_fetches_each_byte_once(s3):
    local = s3["local"][0]
    idx = index_shard(url(local))
    before = storage.counters()
    got = list(read_samples(url(local), idx.samples, ReadLimits()))
    assert not any(r.problem for r in got)
    assert storage.counters()["bytes"] - before["bytes"] <= os.path.getsize(local)


def test_a_kept_listing_of_an_object_is_used_while_its_etag_holds(s3, tmp_path):
    """An object's listing is read back with one metadata request and no ranged GET of its headers;
    a rewritten object (new ETag) is listed from the store again."""
    import boto3

    from datasvc.read.listings import ShardListings

    shard, directory = url(s3["local"][0]), str(tmp_path / "listings")
    first = ShardListings(directory)
    assert first.index(shard) == index_shard(shard) and first.listed == 1
    expected = index_shard(shard)
    logged = len(s3["proxy"].requests)
    again = ShardListings(directory)
    kept = again.index(shard)
    assert not [m for m, _ in s3["proxy"].requests[logged:] if m == "GET"]
    assert kept == expected and again.loaded == 1 and again.listed == 0

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    client.upload_file(s3["local"][1], BUCKET, f"shards/{os.path.basename(s3['local'][0])}")  # rewritten
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # s3fs caches object metadata per instance
    try:
        changed = ShardListings(directory)
        assert changed.index(shard).samples == index_shard(s3["local"][1]).samples and changed.listed == 1
    finally:
        client.upload_file(s3["local"][0], BUCKET, f"shards/{os.path.basename(s3['local'][0])}")
        s3fs.S3FileSystem.clear_instance_cache()
