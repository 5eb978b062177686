"""Text through tiktoken gives exactly the tokenizer's ids, or the tokenizer is kept: the bundled
Qwen3 and Qwen3.5 tokenizers take the fast path and agree with ``tokenizers`` on a multi-script
fuzz corpus, decomposed text and added tokens; tokenizers whose rules tiktoken cannot reproduce are
refused; a lone surrogate is refused on both paths alike. Offline."""
import random
import unicodedata

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from datasvc.pack import fast_bpe, text
from datasvc.pack.fast_bpe import SPLITS_ALIKE_ON_BOTH_ENGINES, ExactBPE, fast_text_encoder
from datasvc.pack.text import ChatMLEncoder, ChatTokens, load_tokenizer
from datasvc.rejects import SampleRejected

TOKENS = ChatTokens(im_start=-1, im_end=-2, vision_start=-3, vision_end=-4, image_pad=-5, pad=-6)


@pytest.fixture(scope="module", params=["qwen3vl", "qwen35vl"])
def bundled(request) -> Tokenizer:
    if request.param == "qwen3vl":
        from pipelines.qwen3vl.data import bundled_qwen3_tokenizer_dir

        return load_tokenizer(bundled_qwen3_tokenizer_dir())
    from pipelines.qwen35vl.tokenizer import bundled_tokenizer_file

    return load_tokenizer(bundled_tokenizer_file())


def _hf(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


POOLS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèêëàçñøåßſİıŁœÆǅǈ",
    "cyrillic": "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЁЖЗИЙЮЯїієґ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΩάέήίόύώΐ",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهويءآأؤإئ\u064b\u064c\u064d\u064e\u064f\u0650\u0651\u0652",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשת\u05b0\u05b4\u05bc\u05c1",
    "devanagari": "कखगघङचछजझञटठडढणतथदधनपफबभमयरलवशषसह\u093e\u093f\u0940\u0941\u0947\u094d\u093c\u0902",
    "thai": "กขคงจฉชซญดตถทนบปผพฟภมยรลวศสหอฮ\u0e31\u0e34\u0e35\u0e48\u0e49\u0e4a",
    "hangul": "한국어가나다라마바사아자차카타파하\u1100\u1161\u11a8\u3131\u314f",
    "cjk": "中文字漢語日本語東京大阪北京上海的一是不了人我在有他这为之",
    "kana": "ひらがなカタカナアイウエオャュョッー",
    "emoji": "😀🙂🎉👍🏽👨\u200d👩\u200d👧❤\ufe0f🇩🇪🏳\ufe0f\u200d🌈",
    "marks": "\u0300\u0301\u0302\u0303\u0308\u0316\u0323\u0327\u0334\u0345\u034f\u0898\u1ac1\u1dfa\u20d7\ufe20",
    "digits": "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५६७८९０１２３４５６７８９²½Ⅻ",
    "space": " \t\n\r\u3000\u00a0\u2028\u2029\u0085\u200b\u180e\u2009\u202f\x0b\x0c",
    "punct": ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`’“”…—–«»¿¡、。「」",
    "control": "\x00\x01\x07\x1b\x7f\u200e\u200f\ufeff\U000e0001",
    "rare": "\ue000\U0001d400\U00020000\U0010fffd\u2126\u212b\uf900\u0390",
}
WORDS = ["don't", "IT'S", "we'll", "You'RE", "I'm", "they've", "she'd", "it’s", "'s", "'LL", "\r\n", "  \n",
         "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "<tts_pad>", "<|im_start|>",
         "<|endoftext|>", "<think", "Kaffee", " Материал", "hello world", "1234567", "x=y+1;", "  ", "\n\n\n"]


def _fuzz(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pools = list(POOLS.values())
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.2:
                parts.append(rng.choice(WORDS))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
            if rng.random() < 0.4:
                parts.append(rng.choice(" \n'"))
        out.append("".join(parts))
    return out


def test_the_bundled_tokenizers_take_the_fast_path(bundled):
    assert isinstance(fast_text_encoder(bundled), ExactBPE)
    assert fast_text_encoder(bundled) is fast_text_encoder(bundled)  # built and checked once


def test_ids_equal_the_tokenizers_on_a_multi_script_fuzz_corpus(bundled):
    fast = fast_text_encoder(bundled)
    corpus = _fuzz(3000)
    mismatched = [t for t, ids in zip(corpus, _hf(bundled, corpus)) if fast(t) != ids]
    assert not mismatched, mismatched[:3]


def test_decomposed_text_is_composed_as_the_tokenizer_composes_it(bundled):
    fast = fast_text_encoder(bundled)
    corpus = [unicodedata.normalize("NFD", t) for t in _fuzz(1500, seed=1)]
    corpus += ["e\u0301", "한국어", unicodedata.normalize("NFD", "한국어 café Ελλάδα ḱṓ"),
               "a\u0316\u0898", "a\u0898\u0316", "a\u0301\u1ac1\u0323", "\u0345\u0334x", "\uf900\u2126"]
    assert sum(not unicodedata.is_normalized("NFC", t) for t in corpus) > 500  # NFC has work to do
    mismatched = [t for t, ids in zip(corpus, _hf(bundled, corpus)) if fast(t) != ids]
    assert not mismatched, mismatched[:3]


def test_added_tokens_in_text_are_matched_as_the_tokenizer_matches_them(bundled):
    fast = fast_text_encoder(bundled)
    texts = ["Let me think. <think>step one</think> done", "<tool_call>{\"a\": 1}</tool_call>",
             "</tool_call></tool_call><tool_response>x</tool_response>", "a<think>b<think>c", "<think",
             "<|im_start|>user<|im_end|>", "<|im_start|><think></think>"]
    hf = _hf(bundled, texts)
    assert [fast(t) for t in texts] == hf
    think = bundled.token_to_id("<think>")
    assert think in hf[0]  # a non-special added token is matched inside text, on both paths


def test_chatml_ids_are_the_same_on_both_paths(bundled, monkeypatch):
    messages = [{"role": "user", "content": ["Что это? 這是什麼？ <think>hmm</think> e\u0301 it's"]},
                {"role": "assistant", "content": ["<tool_call>{\"name\": \"x\"}</tool_call> ١٢٣ 😀 <|im_end|>"]}]
    fast = ChatMLEncoder(bundled, TOKENS).encode(messages, [])
    monkeypatch.setattr(text, "fast_text_encoder", lambda tokenizer: None)
    slow = ChatMLEncoder(bundled, TOKENS).encode(messages, [])
    assert fast[0].tolist() == slow[0].tolist() and fast[1].tolist() == slow[1].tolist()


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_lone_surrogate_is_refused_on_both_paths(bundled, monkeypatch, fast_path):
    if not fast_path:
        monkeypatch.setattr(text, "fast_text_encoder", lambda tokenizer: None)
    encoder = ChatMLEncoder(bundled, TOKENS)
    messages = [{"role": "user", "content": ["a lone \ud800 surrogate"]}, {"role": "assistant", "content": ["ok"]}]
    with pytest.raises(SampleRejected) as refused:
        encoder.encode(messages, [])
    assert refused.value.reason == "text_not_utf8" and "surrogate" in refused.value.detail


def test_the_qwen35_split_pattern_is_one_compared_on_both_engines():
    from pipelines.qwen35vl.tokenizer import SPLIT

    assert SPLIT in SPLITS_ALIKE_ON_BOTH_ENGINES


def test_tokenizers_unicode_tables_are_not_newer_than_pythons():
    """The fast path skips tokenizers' NFC where Python's check finds text already NFC, which holds
    while tokenizers' tables are the older: no code point Python holds unassigned is a combining
    mark or a decomposition to tokenizers."""
    unassigned = [chr(c) for c in range(0x110000)
                  if not 0xD800 <= c < 0xE000 and unicodedata.category(chr(c)) == "Cn"]
    probes = "".join(f"!{c}\u0334!\u0345{c}" for c in unassigned)
    assert normalizers.NFC().normalize_str(probes) == probes


# A tiny byte-level BPE: every byte a token, then "ab", "bc", "abc".
def _tiny(merges: list[tuple[str, str]], extra: dict[str, int], **bpe) -> Tokenizer:
    vocab = {c: b for c, b in fast_bpe._byte_of_char().items()} | extra
    tokenizer = Tokenizer(models.BPE(vocab, merges, **bpe))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


TINY_TEXTS = ["abc", "abcabc", " abc bc ab", "xabcx", "a b c", "bcab", "ab\ncd", "ááa"]


def _chat_ids_match_the_tokenizer(tokenizer: Tokenizer) -> bool:
    encoder = ChatMLEncoder(tokenizer, TOKENS)
    ids, _ = encoder.encode([{"role": "user", "content": [TINY_TEXTS[0]]},
                             {"role": "assistant", "content": [TINY_TEXTS[2]]}], [])

    def piece(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    expected = ([-1] + piece("user\n") + piece(TINY_TEXTS[0]) + [-2] + piece("\n")
                + [-1] + piece("assistant\n") + piece(TINY_TEXTS[2]) + [-2] + piece("\n"))
    return ids.tolist() == expected


def test_a_tiny_bpe_in_id_order_takes_the_fast_path_even_with_an_unreachable_token():
    assert fast_text_encoder(_tiny([("a", "b")], {"ab": 256})) is not None  # what the refusals below change
    # No merge builds "abc": tokenizers never returns it, so it is left out of tiktoken's ranks.
    tokenizer = _tiny([("a", "b"), ("b", "c")], {"ab": 256, "bc": 257, "abc": 258})
    fast = fast_text_encoder(tokenizer)
    assert fast is not None
    assert [fast(t) for t in TINY_TEXTS] == _hf(tokenizer, TINY_TEXTS)
    assert 258 not in fast("abc")
    assert _chat_ids_match_the_tokenizer(tokenizer)


def _with(tokenizer: Tokenizer, **parts) -> Tokenizer:
    changed = Tokenizer.from_str(tokenizer.to_str())
    for name, part in parts.items():
        setattr(changed, name, part)
    return changed


REFUSED = {
    "merges out of id order": lambda: _tiny([("b", "c"), ("a", "b")], {"ab": 256, "bc": 257}),
    "an unreachable token looked up whole": lambda: _tiny([("a", "b"), ("b", "c")],
                                                          {"ab": 256, "bc": 257, "abc": 258}, ignore_merges=True),
    "a normalizer other than NFC": lambda: _with(_tiny([("a", "b")], {"ab": 256}), normalizer=normalizers.NFKC()),
    "a Metaspace pre-tokenizer": lambda: _with(_tiny([("a", "b")], {"ab": 256}),
                                               pre_tokenizer=pre_tokenizers.Metaspace()),
    "a split pattern not compared on both engines": lambda: _with(_tiny([("a", "b")], {"ab": 256}), pre_tokenizer=(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}{1,3}|\S+|\s+"), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))),
    "a prefix space": lambda: _with(_tiny([("a", "b")], {"ab": 256}),
                                    pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "dropout": lambda: _tiny([("a", "b")], {"ab": 256}, dropout=0.5),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_tokenizer_tiktoken_cannot_reproduce_keeps_its_own_ids(case):
    tokenizer = REFUSED[case]()
    assert fast_text_encoder(tokenizer) is None
    if case != "dropout":  # dropout's ids are random by design
        assert _chat_ids_match_the_tokenizer(tokenizer)


def test_the_text_bench_finds_both_bundled_tokenizers_on_the_fast_path_with_the_same_ids(tmp_path):
    import json

    from datasvc.tools.bench import text as text_bench

    out = tmp_path / "text.json"
    assert text_bench.main(["--samples", "12", "--passes", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["tokenizers"]
    assert set(rows) == {"qwen3vl", "qwen35vl"}
    for r in rows.values():
        assert r["fast_path_taken"] and r["samples_with_other_ids"] == 0
        assert r["text_tokens_per_sample"] > 100  # LLaVA-style conversations, not captions
