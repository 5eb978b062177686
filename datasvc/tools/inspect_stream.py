"""``vlmfeed inspect``'s packed mode: the rank's micro-batches from the feeder's own block producer,
each written as its arrays, its contact sheet and its decoded text (see ``datasvc.tools.inspect``)."""
from __future__ import annotations

from types import SimpleNamespace

from datasvc.tools import inspect_arrays
from datasvc.tools.inspect_samples import SampleRecorder
from datasvc.tools.inspect_sheet import draw_sheet, micro_batch_tiles
from datasvc.tools.inspect_text import RowDecoder, micro_batch_text, preview, vision_token_ids


def write_stream(cfg, config, recorder: SampleRecorder, files, progress) -> dict:
    """Write the rank's micro-batches in delivery order until ``config.limit`` samples; the table's
    rows (delivered ones in delivery order, then the rejected), accounting, rejections, packing figures."""
    from datasvc.stream.producer import BlockProducer

    pipeline = recorder.processor.pipeline
    decoder = RowDecoder(pipeline.tokenizer, vision_token_ids(pipeline), recorder.spec.merge_size)
    records, delivered, first_texts = [], [], []

    def process(item):
        result = recorder(item)
        progress.update(f"{len(recorder.rows)} samples read, {len(records)} micro-batches written")
        return result

    producer = BlockProducer(cfg, config.rank, process=process)
    stopped = False
    for batch, pos in producer.micro_batches():
        rows = [recorder.by_full_key[k] for k in batch.sample_keys]
        record, texts = _write_micro_batch(len(records), batch, pos, rows, recorder.spec, decoder, files)
        records.append(record)
        delivered.extend(rows)
        first_texts = first_texts or texts
        progress.update(f"{len(recorder.rows)} samples read, {len(records)} micro-batches written")
        if config.limit and len(delivered) >= config.limit:
            stopped = True
            break
    too_long = recorder.mark_too_long(cfg.seq_len)
    accounting = producer.stats().as_dict()["accounting"]
    shard_order = {p: i for i, p in enumerate(cfg.shards)}
    not_delivered = sorted((r for r in recorder.rows.values() if r["status"] != "ok"),
                           key=lambda r: (shard_order.get(r["shard"], len(shard_order)), r["index"], r["key"]))
    return {"rows": delivered + not_delivered, "accounting": accounting, "stopped": stopped,
            "rejections": recorder.rejections + too_long, "preview": preview(first_texts),
            "packing": _packing_figures(cfg, config.rank, records, delivered, recorder)}


def _write_micro_batch(index: int, batch, pos, rows: list[dict], spec, decoder: RowDecoder, files):
    """packed-, sheet- and text-NNNNN of one micro-batch; (its summary record, its samples' text)."""
    name = f"{index:05d}"
    packed = f"packed-{name}.npz"
    for row, sample_row in zip(rows, batch.sample_rows.tolist()):
        row.update(file=packed, row=int(sample_row))
    arrays = inspect_arrays.packed_arrays(batch, spec, rows, (pos.epoch, pos.block, pos.batch, pos.step))
    inspect_arrays.save(files.path(packed), arrays)
    files.added(packed)
    texts = decoder.micro_batch(arrays)
    files.text(f"text-{name}.txt", micro_batch_text(f"micro-batch {name}", pos.as_dict(), arrays, texts))
    image_tokens = int((batch.tokens == decoder.ids.image_pad).sum())
    video_tokens = int((batch.tokens == decoder.ids.video_pad).sum()) if decoder.ids.video_pad is not None else 0
    sheet = f"sheet-{name}.png"
    title = (f"micro-batch {name} (step {pos.step}): {batch.tokens.shape[0]} rows, {len(rows)} samples, "
             f"{len(arrays['image_grid_thw'])} images, {len(arrays['video_grid_thw'])} videos, "
             f"vision tokens {image_tokens} image + {video_tokens} video")
    layout = draw_sheet(micro_batch_tiles(arrays, spec.merge_size), files.path(sheet), title)
    files.added(sheet)
    record = {"packed": packed, "sheet": sheet, "text": f"text-{name}.txt", "position": pos.as_dict(),
              "rows": int(batch.tokens.shape[0]), "samples": len(rows), "real_tokens": batch.real_tokens,
              "row_tokens": int(batch.tokens.size), "image_tokens": image_tokens, "video_tokens": video_tokens,
              "sheet_tiles": layout.tiles, "sheet_tiles_shown": layout.shown,
              "fields": inspect_arrays.rank_field_shapes(arrays, spec)}
    return record, texts


def _packing_figures(cfg, rank: int, records: list[dict], delivered: list[dict], recorder: SampleRecorder) -> dict:
    from datasvc.pack.packing import padding_efficiency

    lengths = [r["tokens"] for r in delivered] + [r["tokens"] for r in recorder.rows.values()
                                                   if r["reason"] == "longer_than_seq_len"]
    real = sum(r["real_tokens"] for r in records)
    row_tokens = sum(r["row_tokens"] for r in records)
    return {
        "seq_len": cfg.seq_len, "micro_batch_size": cfg.micro_batch_size, "rank": rank, "dp_size": cfg.dp_size,
        "seed": cfg.seed, "items_per_block": cfg.items_per_block, "chain_blocks": cfg.chain_blocks,
        "micro_batches": len(records), "rows": sum(r["rows"] for r in records), "real_tokens": real,
        "row_tokens": row_tokens, "samples_too_long": sum(n > cfg.seq_len for n in lengths),
        "packing_efficiency": round(real / max(1, row_tokens), 4),
        "padding_efficiency": round(padding_efficiency([SimpleNamespace(num_tokens=n) for n in lengths],
                                                       cfg.seq_len), 4),
        "rows_if_padded": sum(n <= cfg.seq_len for n in lengths),
        "image_tokens": sum(r["image_tokens"] for r in records), "video_tokens": sum(r["video_tokens"] for r in records),
        "files": [r["packed"] for r in records], "positions": [r["position"] for r in records],
        "micro_batch_files": records,
    }
