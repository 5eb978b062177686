"""How fast is chat text tokenized? The chat encoder's text through ``tokenizers`` and through the
exact ``tiktoken`` path (``datasvc.pack.fast_bpe``), on the same conversations, per bundled
tokenizer: microseconds a text token and milliseconds a sample on one thread, best of the passes,
and whether every sample's ids agree.

    python -m datasvc.tools.bench.text [--profile llava-sft] [--samples 256] [--passes 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from datasvc.tools.bench.provenance import stamp
from datasvc.usage import HelpFormatter, positive_int

QUESTION = "How fast is chat text tokenized?"


def conversations(profile: str, samples: int) -> list[list[dict]]:
    """The messages of ``samples`` synthetic samples of ``profile`` (seed 0, cached as shards)."""
    from datasvc.read.formats import sample_messages
    from datasvc.read.shards import ReadLimits, index_shard, read_samples
    from datasvc.rejects import SampleRejected
    from datasvc.tools.synth import cached_profile_shards

    out = []
    for path in cached_profile_shards(profile, samples):
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            if raw.problem:
                continue
            try:
                out.append(sample_messages(raw, len(raw.images)))
            except SampleRejected:
                continue
    return out


def _tokenizers() -> dict:
    """Each bundled pipeline's tokenizer, by pipeline name (the pipelines own their tokenizers)."""
    from datasvc.registry import get_pipeline

    return {name: get_pipeline(name).tokenizer for name in ("qwen3vl", "qwen35vl")}


def measure(tokenizer, samples: list[list[dict]], passes: int) -> dict:
    """Both paths of one tokenizer's chat encoder over ``samples``; images count one pad each."""
    from datasvc.pack.fast_bpe import fast_text_encoder
    from datasvc.pack.text import ChatMLEncoder, ChatTokens
    from datasvc.rejects import IMAGE
    from datasvc.tools.bench.timing import one_thread

    tokens = ChatTokens(im_start=-1, im_end=-2, vision_start=-3, vision_end=-4, image_pad=-5, pad=-6)
    t0 = time.perf_counter()
    fast = ChatMLEncoder(tokenizer, tokens)
    build_s = time.perf_counter() - t0
    slow = ChatMLEncoder(tokenizer, tokens, fast_text=False)
    images = [[1] * sum(part is IMAGE for m in msgs for part in m["content"]) for msgs in samples]
    out = {"fast_path_taken": fast_text_encoder(tokenizer) is not None, "build_s": round(build_s, 3)}
    ids = {}
    with one_thread():
        for name, enc in (("tokenizers", slow), ("tiktoken", fast)):
            best = float("inf")
            for _ in range(passes):
                t = time.process_time()
                got = [enc.encode(msgs, n)[0] for msgs, n in zip(samples, images)]
                best = min(best, time.process_time() - t)
            ids[name] = got
            text_tokens = sum(len(g) for g in got) - sum(map(sum, images))
            out[name] = {"us_per_text_token": round(best / text_tokens * 1e6, 3),
                         "ms_per_sample": round(best / len(samples) * 1e3, 3)}
    out["text_tokens_per_sample"] = round(text_tokens / len(samples), 1)
    out["speedup"] = round(out["tokenizers"]["us_per_text_token"] / out["tiktoken"]["us_per_text_token"], 2)
    out["samples_with_other_ids"] = int(sum((a != b).any() if len(a) == len(b) else True
                                            for a, b in zip(ids["tokenizers"], ids["tiktoken"])))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="vlmfeed bench text", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--profile", default="llava-sft", help="synthetic samples of this profile (vlmfeed synth --help)")
    ap.add_argument("--samples", type=positive_int, default=256)
    ap.add_argument("--passes", type=positive_int, default=3, help="passes per path (the fastest is kept)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    samples = conversations(args.profile, args.samples)
    rows = {name: measure(tok, samples, args.passes) for name, tok in _tokenizers().items()}
    print(f"{'tokenizer':10} {'tokenizers us/token':>20} {'tiktoken us/token':>18} {'speed-up':>9} "
          f"{'ms/sample':>16} {'other ids':>9} {'build s':>8}")
    for name, r in rows.items():
        print(f"{name:10} {r['tokenizers']['us_per_text_token']:>20.3f} {r['tiktoken']['us_per_text_token']:>18.3f} "
              f"{r['speedup']:>8.2f}x {r['tokenizers']['ms_per_sample']:>7.2f} -> {r['tiktoken']['ms_per_sample']:<5.2f} "
              f"{r['samples_with_other_ids']:>9} {r['build_s']:>8.2f}")
    rep = stamp({"profile": args.profile, "samples": len(samples), "passes": args.passes, "tokenizers": rows},
                QUESTION, "vlmfeed bench text " + " ".join(argv))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if all(r["samples_with_other_ids"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
