"""Packing efficiency against padding every sample to ``seq_len``, from image headers only."""
from __future__ import annotations

import os

import numpy as np


def encoded_from_headers(shards: list[str], pipeline) -> tuple[list, dict]:
    """EncodedSamples with exact token rows, grids from the headers (no pixels: packing needs
    only lengths and patch counts, so patches are zero-width arrays of the right row count)."""
    from datasvc.batch import EncodedSample
    from datasvc.media.vision import ImageRejected
    from datasvc.pack.headers import encode_from_headers
    from datasvc.read.shards import ReadLimits, index_shard, read_samples
    from datasvc.rejects import Accounting, SampleRejected

    acct = Accounting()
    out = []
    for path in shards:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            acct.read += 1
            try:
                ids, labels, grids = encode_from_headers(raw, pipeline)
            except (ImageRejected, SampleRejected) as exc:
                acct.reject(raw.shard, raw.key, exc.reason, exc.detail)
                continue
            n_patches = sum(t * h * w for t, h, w in grids)
            out.append(EncodedSample(raw.key, raw.shard, ids, labels, np.zeros((n_patches, 0), np.uint8),
                                     np.asarray(grids, np.int64).reshape(-1, 3)))
    return out, acct.as_dict()


def packing_report(samples: list, seq_lens=(4096, 8192), micro_batch_size: int = 1, pad_id: int = 0) -> dict:
    from datasvc.pack.packing import PackingConfig, pack, padding_efficiency

    report = {}
    lengths = np.array([s.num_tokens for s in samples])
    for seq_len in seq_lens:
        batches, too_long = pack(samples, PackingConfig(seq_len=seq_len, micro_batch_size=micro_batch_size,
                                                        pad_id=pad_id), 0)
        real = sum(b.real_tokens for b in batches)
        rows = sum(b.tokens.shape[0] for b in batches)
        report[str(seq_len)] = {
            "samples": len(samples), "too_long": len(too_long),
            "rows_packed": rows, "rows_padded": len(samples) - len(too_long),
            "packing_efficiency": round(real / max(1, rows * seq_len), 4),
            "padding_efficiency": round(padding_efficiency(samples, seq_len), 4),
        }
        report[str(seq_len)]["row_reduction"] = round(
            report[str(seq_len)]["rows_padded"] / max(1, rows), 2)
    report["tokens_per_sample"] = {"mean": float(lengths.mean()) if len(lengths) else 0.0,
                                   "p50": float(np.median(lengths)) if len(lengths) else 0.0,
                                   "max": int(lengths.max()) if len(lengths) else 0}
    return report


def packing_bench(synth_samples: int, max_pixels: int, seq_lens=(4096, 8192), tmp: str | None = None,
                  photo_copies: int = 2, pipeline_name: str = "qwen3vl") -> dict:
    """Packing of the real-photo shards plus synthetic web-photo captions/conversations."""
    import tempfile

    from datasvc.registry import get_pipeline
    from datasvc.samples import write_photo_shards
    from datasvc.tools.synth import write_shards

    pipeline = get_pipeline(pipeline_name, max_pixels=max_pixels)
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        shards = write_photo_shards(os.path.join(d, "photos"), samples_per_shard=32, copies=photo_copies)
        if synth_samples > 0:
            shards += write_shards(os.path.join(d, "synth"), synth_samples, profile="web-photos", seed=3,
                                         samples_per_shard=256, progress=False)
        samples, acct = encoded_from_headers(shards, pipeline)
    rep = packing_report(samples, seq_lens, pad_id=pipeline.pad_id)
    rep["accounting"] = acct
    rep["max_pixels"] = max_pixels
    rep["sources"] = {"photo_shard_samples": acct["read"] - synth_samples, "synth_web_photos_samples": synth_samples}
    return rep
