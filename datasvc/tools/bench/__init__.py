"""Benchmarks of the data path; ``vlmfeed bench`` (``datasvc.tools.bench.cli``) runs them.

- ``photos``: the photo set the per-core numbers use, and the one-thread scope they run in.
- ``decode``: per-core decode and preprocess throughput; ``packing``: packing against padding.
- ``service``: the Ray-streamed service against the in-process path.
- ``sizing``: block sizing's estimate against the whole set.
- ``soak``: streaming good and hostile shards while faults are injected.
- ``gpu_decode_probe``: where DALI GPU decode time goes (needs CUDA).
"""
