"""The sample shapes users bring (img2dataset / LAION metadata, LLaVA, ShareGPT, OpenAI / HF chat parts,
system prompts, interleaved images), their exact ChatML, and the filters they apply."""
import json
import os

import numpy as np
import pytest
import webdataset as wds

from datasvc.batch import IGNORE_INDEX
from datasvc.config import ServiceConfig
from datasvc.read.filters import Rule, SampleRules, rules_from_flags
from datasvc.read.shards import RawSample, ReadLimits, index_shard, read_samples
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import process_item
from datasvc.wire import WorkItem
from pipelines.qwen3vl.data import HF_CHAT_TEMPLATE

# Qwen3-VL-Instruct's chat template, as the model's package keeps it; Qwen3VLProcessor then repeats each
# <|image_pad|> once per vision token.
QWEN3_VL_TEMPLATE = HF_CHAT_TEMPLATE
VS, VE, PAD = 151652, 151653, 151655


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from pipelines.qwen3vl.data import bundled_qwen3_tokenizer_dir

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(bundled_qwen3_tokenizer_dir(), "tokenizer.json"))


def hf_ids(hf_tokenizer, messages, image_tokens):
    text = hf_tokenizer.apply_chat_template(messages, chat_template=QWEN3_VL_TEMPLATE, tokenize=False)
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(image_tokens) + 1
    text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(image_tokens, pieces[1:]))
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def image_token_counts(qwen3vl, grids):
    return [qwen3vl.vision.vision_tokens(g) for g in grids]


OPENAI = {"messages": [
    {"role": "system", "content": [{"type": "text", "text": "You compare photographs."}]},
    {"role": "user", "content": [{"type": "text", "text": "Here is one: "}, {"type": "image"},
                                 {"type": "text", "text": " and another "}, {"type": "image"},
                                 {"type": "text", "text": "\nWhich is brighter?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The first."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this <image> one?"}]},
    {"role": "assistant", "content": "Darker than both."}]}


def test_openai_parts_match_the_qwen3_vl_template_exactly(qwen3vl, hf_tokenizer):
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]
    ids, labels = qwen3vl.encode(RawSample("s", "k", [], None, OPENAI), grids)
    assert ids.tolist() == hf_ids(hf_tokenizer, OPENAI["messages"], image_token_counts(qwen3vl, grids))
    # Pads land where the parts are, in order: 6, then 1, then 6 vision tokens.
    starts = np.flatnonzero(ids == VS)
    assert [int(np.flatnonzero(ids[s:] == VE)[0]) - 1 for s in starts] == [6, 1, 6]
    # The literal "<image>" in a text part stays text; only the replies (and their im_end) are supervised.
    assert "And this <image> one?" in qwen3vl.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    targets = qwen3vl.tokenizer.decode([int(t) for t in labels if t != IGNORE_INDEX], skip_special_tokens=False)
    assert targets == "The first.<|im_end|>Darker than both.<|im_end|>"


def test_llava_and_sharegpt_render_as_the_same_chat(qwen3vl, hf_tokenizer):
    llava = {"id": "000000033471", "image": "coco/train2017/000000033471.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat are the colors of the bus?"},
        {"from": "gpt", "value": "The bus is white and red."},
        {"from": "human", "value": "Compare it with <image>"},
        {"from": "gpt", "value": "Both are buses."}]}
    sharegpt = {"system": "Answer briefly.", "conversations": [
        {"from": "human", "value": "<image>Describe."}, {"from": "gpt", "value": "A cat."}]}
    grids = [(1, 2, 4), (1, 4, 4)]
    ids, _ = qwen3vl.encode(RawSample("s", "k", [], None, llava), grids)
    as_parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat are the colors of the bus?"}]},
        {"role": "assistant", "content": "The bus is white and red."},
        {"role": "user", "content": [{"type": "text", "text": "Compare it with "}, {"type": "image"}]},
        {"role": "assistant", "content": "Both are buses."}]
    assert ids.tolist() == hf_ids(hf_tokenizer, as_parts, image_token_counts(qwen3vl, grids))
    ids, _ = qwen3vl.encode(RawSample("s", "k", [], None, sharegpt), [(1, 2, 2)])
    expected = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
                {"role": "assistant", "content": "A cat."}]
    assert ids.tolist() == hf_ids(hf_tokenizer, expected, [1])


def test_caption_is_text_even_with_a_literal_image_marker(qwen3vl, hf_tokenizer):
    raw = RawSample("s", "k", [], "A sign that reads <image> in red.", None)
    ids, _ = qwen3vl.encode(raw, [(1, 2, 4)])
    expected = [{"role": "user", "content": [{"type": "image"}]},
                {"role": "assistant", "content": "A sign that reads <image> in red."}]
    assert ids.tolist() == hf_ids(hf_tokenizer, expected, [2])


def test_a_conversation_without_placeholders_gets_its_images_first(qwen3vl):
    convo = {"messages": [{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Two cats."}]}
    ids, _ = qwen3vl.encode(RawSample("s", "k", [], None, convo), [(1, 2, 2), (1, 2, 4)])
    first_text = int(np.flatnonzero(ids == VE)[-1]) + 1
    assert (ids[:first_text] == PAD).sum() == 3 and (ids == VS).sum() == 2


@pytest.mark.parametrize("doc, n_images, reason", [
    ({"conversations": [{"from": "human", "value": "<image><image>Hi"}, {"from": "gpt", "value": "Yo"}]}, 1,
     "image_count_mismatch"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]}, 2,
     "image_count_mismatch"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<image> a"}]}, 0,
     "image_count_mismatch"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a"}]}, 1, "image_count_mismatch"),
    ({"messages": [{"role": "tool", "content": "q"}]}, 0, "bad_conversation"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 0, "bad_conversation"),
    ({"messages": [{"role": "user", "content": 3}]}, 0, "bad_conversation"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, 0, "no_assistant_reply"),
    ([1, 2], 0, "bad_conversation"),
    ("a string", 0, "bad_conversation"),
])
def test_broken_conversations_have_their_reason(qwen3vl, doc, n_images, reason):
    from datasvc.rejects import SampleRejected

    with pytest.raises(SampleRejected) as exc:
        qwen3vl.encode(RawSample("s", "k", [], None, doc), [(1, 2, 2)] * n_images)
    assert exc.value.reason == reason


def write_img2dataset_shard(path, photos):
    """The img2dataset layout: key.jpg + key.txt + key.json (metadata), as LAION/DataComp/CC12M ship."""
    with wds.TarWriter(path) as sink:
        for i, (name, img, caption) in enumerate(photos):
            meta = {"url": f"https://example.com/{name}.jpg", "caption": caption, "key": f"{i:09d}",
                    "status": "success" if i % 4 else "failed_to_resize", "width": int(img.shape[1]),
                    "height": int(img.shape[0]), "similarity": round(0.2 + 0.02 * i, 3), "error_message": None}
            sample = {"__key__": f"{i:09d}", "jpg": encode_image(img[..., :3] if img.ndim == 3 else img),
                      "json": json.dumps(meta).encode()}
            if i % 3:  # some have the .txt, the others only the JSON caption
                sample["txt"] = caption
            sink.write(sample)


@pytest.fixture(scope="module")
def laion_shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("laion") / "00000.tar")
    photos = [p for p in real_photos() if p[1].ndim == 3 and p[1].shape[2] == 3][:10]
    write_img2dataset_shard(path, photos)
    return path, photos


def test_img2dataset_shard_is_read_with_its_metadata(laion_shard, qwen3vl, cpu_decoder):
    path, photos = laion_shard
    idx = index_shard(path)
    raws = list(read_samples(path, idx.samples, ReadLimits()))
    assert [r.text for r in raws] == [c for _, _, c in photos]
    assert all(r.conversation is None and r.metadata["url"].endswith(".jpg") for r in raws)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    assert len(res.samples) == 10 and not res.accounting.quarantined
    assert res.accounting.balanced(in_flight=len(res.samples))


def test_filters_skip_by_rule_and_name_it(laion_shard, qwen3vl, cpu_decoder):
    path, photos = laion_shard
    idx = index_shard(path)
    rules = SampleRules.parse(rules_from_flags(["similarity>=0.28", 'status == "success"'], min_image_side=300))
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder, ReadLimits(), rules)
    expected = {}
    for i, (_, img, _) in enumerate(photos):
        if not 0.2 + 0.02 * i >= 0.28:
            why = "filter:similarity>=0.28"
        elif not i % 4:
            why = "filter:status==success"
        elif min(img.shape[:2]) < 300:
            why = "filter:image_min_side>=300"
        else:
            continue
        expected[why] = expected.get(why, 0) + 1
    assert dict(res.accounting.skipped_by_rule) == expected and not res.accounting.quarantined
    assert len(res.samples) == 10 - sum(expected.values()) > 0
    assert res.accounting.balanced(in_flight=len(res.samples))


def raw_with(images=(), text="a caption", metadata=None, conversation=None):
    return RawSample("s", "k", list(images), text, conversation, metadata=metadata or {})


def test_rules_on_images_captions_and_metadata():
    wide = encode_image(np.zeros((40, 200, 3), np.uint8))
    square = encode_image(np.zeros((100, 100, 3), np.uint8))
    check = lambda specs, raw: SampleRules.parse(specs).check(raw)
    assert check(["image_aspect<=3"], raw_with([("jpg", square), ("jpg", wide)])) == "filter:image_aspect<=3"
    assert check(["image_aspect<=5", "image_max_side<=200"], raw_with([("jpg", wide)])) is None
    assert check(["image_min_side>=64"], raw_with([("jpg", wide)])) == "filter:image_min_side>=64"
    assert check(["image_min_side>=64"], raw_with()) is None  # no images: not the image rules' to judge
    assert check(["caption_chars>=10"], raw_with(text="short")) == "filter:caption_chars>=10"
    convo = {"messages": [{"role": "user", "content": "a long question here"}, {"role": "assistant", "content": "ok"}]}
    assert check(["caption_chars<=2"], raw_with(text=None, conversation=convo)) is None
    assert check(["similarity>=0.28"], raw_with(metadata={"similarity": "0.3"})) is None
    assert check(["similarity>=0.28"], raw_with(metadata={})) == "filter:similarity>=0.28"  # lacking fails
    assert check(["similarity>=0.28"], raw_with(metadata={"similarity": "n/a"})) == "filter:similarity>=0.28"
    assert check(["status!=failed"], raw_with(metadata={"status": "success"})) is None
    assert check(["exif.Make==Canon"], raw_with(metadata={"exif": {"Make": "Canon"}})) is None
    assert check(["images==1"], raw_with([("jpg", square)])) is None
    assert Rule.parse(" similarity >= 0.28 ").text == "similarity>=0.28"


@pytest.mark.parametrize("spec", ["similarity", "similarity >= ", "__import__('os')>=1", "status>success",
                                  "image_min_side==big", "a=>1"])
def test_bad_rules_fail_fast_naming_the_rule(spec):
    with pytest.raises(ValueError, match="filter"):
        ServiceConfig(shards=("x.tar",), filters=(spec,))


def test_filters_are_part_of_the_fingerprint():
    plain = ServiceConfig(shards=("x.tar",))
    assert plain.fingerprint() == ServiceConfig(shards=("x.tar",), filters=()).fingerprint()
    assert plain.fingerprint() != ServiceConfig(shards=("x.tar",), filters=("status==success",)).fingerprint()


def test_command_line_flags_become_rules():
    import argparse

    from datasvc.read.filters import add_filter_flags, filters_from_flags

    parser = argparse.ArgumentParser()
    add_filter_flags(parser)
    args = parser.parse_args(["--filter", "similarity>=0.28", "--filter", "status==success",
                              "--min-image-side", "64", "--max-aspect", "3"])
    assert filters_from_flags(args) == ("similarity>=0.28", "status==success", "image_min_side>=64",
                                        "image_aspect<=3.0")
    assert filters_from_flags(parser.parse_args([])) == ()
    with pytest.raises(SystemExit):  # a malformed rule is refused while the flags are parsed
        parser.parse_args(["--filter", "similarity"])


@pytest.mark.parametrize("txt, doc, caption, conversation", [
    ("from txt", {"caption": "from json"}, "from txt", False),
    ("  ", {"caption": "from json"}, "from json", False),  # a blank .txt falls back to the metadata
    (None, {"text": "from text key", "similarity": 0.3}, "from text key", False),
    (None, {"url": "u"}, None, False),  # metadata without a caption: missing_text, counted
    (None, {"messages": [], "similarity": 0.3}, None, True),
])
def test_where_the_caption_comes_from(txt, doc, caption, conversation):
    from datasvc.read.formats import attach_json

    raw = RawSample("plain.tar", "k", [], txt, None)
    attach_json(raw, doc)
    assert raw.text == (caption if caption is not None else txt)
    assert (raw.conversation is not None) == conversation
    assert raw.metadata == ({"similarity": 0.3} if conversation else doc)


INVISIBLE = ["", "   \n", "\u200b", "\ufeff", "\u200b\u200c\u200d\u2060\u00ad \u200e", "\u202e\t\x00"]


@pytest.mark.parametrize("text", INVISIBLE)
def test_text_no_one_sees_is_no_caption_and_no_reply(qwen3vl, text):
    """Zero-width and other format characters count as whitespace does: a caption or an assistant
    reply made of them is missing_text, like an empty one, and a blank .txt falls back to the JSON's
    caption."""
    from datasvc.read.formats import attach_json
    from datasvc.rejects import SampleRejected

    reply = {"messages": [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": text}]}
    second = {"conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."},
                                {"from": "human", "value": "And?"}, {"from": "gpt", "value": text}]}
    for raw in (RawSample("s", "k", [], text, None), RawSample("s", "k", [], None, reply),
                RawSample("s", "k", [], None, second)):
        with pytest.raises(SampleRejected) as exc:
            qwen3vl.encode(raw, [(1, 2, 2)])
        assert exc.value.reason == "missing_text"
    raw = RawSample("plain.tar", "k", [], text, None)
    attach_json(raw, {"caption": "from json"})
    assert raw.text == "from json"


def test_a_caption_is_trained_without_its_byte_order_mark(qwen3vl):
    """A .txt saved with a UTF-8 BOM trains the caption, not the mark as its first label token; a
    joiner inside the caption (an emoji sequence) stays."""
    plain, _ = qwen3vl.encode(RawSample("s", "k", [], "A cat \U0001F469\u200d\U0001F4BB.", None), [(1, 2, 2)])
    ids, labels = qwen3vl.encode(RawSample("s", "k", [], "\ufeffA cat \U0001F469\u200d\U0001F4BB.\u200b\n", None),
                                 [(1, 2, 2)])
    assert ids.tolist() == plain.tolist()
    trained = qwen3vl.tokenizer.decode([int(t) for t in labels if t != IGNORE_INDEX], skip_special_tokens=False)
    assert trained == "A cat \U0001F469\u200d\U0001F4BB.<|im_end|>"


def test_samples_with_nothing_to_train_are_counted_in_a_shard(tmp_path, qwen3vl, cpu_decoder):
    photo = encode_image(real_photos()[0][1][..., :3])
    empty_reply = {"conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": ""}]}
    path = str(tmp_path / "text.tar")
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "bom", "jpg": photo, "txt": "\ufeffA rocket.".encode()})
        sink.write({"__key__": "zero_width", "jpg": photo, "txt": "\u200b\u200b".encode()})
        sink.write({"__key__": "spaces", "jpg": photo, "txt": b"   "})
        sink.write({"__key__": "empty_reply", "jpg": photo, "json": json.dumps(empty_reply).encode()})
    idx = index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    assert [s.key for s in res.samples] == ["bom"]
    assert {r.key: r.reason for r in res.accounting.log} == {
        "zero_width": "missing_text", "spaces": "missing_text", "empty_reply": "missing_text"}
    assert "assistant reply 1 of 1 is empty" in next(r.detail for r in res.accounting.log if r.key == "empty_reply")
    trained = [int(t) for t in res.samples[0].labels if t != IGNORE_INDEX]
    assert qwen3vl.tokenizer.decode(trained, skip_special_tokens=False) == "A rocket.<|im_end|>"
