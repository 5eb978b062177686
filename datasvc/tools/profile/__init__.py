"""Standalone data-throughput profiler: ``vlmfeed profile`` (``python -m datasvc.tools.profile``).

Runs the real data service (Ray feeder + preprocessing actors + client, no trainer) on the given
shards for every (micro-batch size, actors) setting, at ``trainer.run``'s block geometry, and
consumes micro-batches as fast as it can. Then it answers: how fast is the data path, where does
its time go, and does it keep a trainer of a given speed fed (a measured step time, or one
estimated from an architecture preset, GPU count, peak TFLOP/s and MFU with the pipeline's FLOP
model)?

- ``measure``: one setting, measured over whole blocks; ``sweep``: ``Settings`` and ``profile`` over many.
- ``verdict``: the trainer's demand and the verdict per MBS.
- ``report``: tables and the figure.
- ``compare``: several sources side by side; ``cost``: in-process image cost and ``synth-check``.
- ``cli``: the command line.
"""
