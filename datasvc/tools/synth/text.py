"""Text of synthetic samples: captions and conversations from a built-in vocabulary."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

IMAGE_MARKER = "<image>"
_MARKERS = (IMAGE_MARKER, "<video>")  # placeholders, not words

# A small caption-flavoured vocabulary. Words within a class are drawn Zipf-like (earlier words
# more often), which gives text a realistic token-frequency skew for tokenizers.
_DET = "a the the a two three some several an one many".split()
_ADJ = ("small large old white black red blue green yellow wooden bright dark wet busy empty "
        "tall narrow open modern ancient quiet crowded sunny cloudy colorful metal glass stone "
        "young smiling happy tired round square soft rusty fresh golden silver distant").split()
_NOUN = ("man woman person dog cat car street building tree table window room city road water "
         "sky field house boat bridge train bus child group bicycle flower plate food sign wall "
         "door chair river mountain beach park shirt hat bag phone computer screen book paper "
         "page chart graph text logo kitchen desk light horse bird cup glass bottle fence grass "
         "snow rock forest lake cloud shadow market crowd truck player ball game team sofa bed "
         "lamp mirror painting garden path tower church station platform airplane field camera").split()
_VERB = ("is standing sitting walking holding looking riding showing lying parked running "
         "wearing carrying eating playing waiting crossing hanging covered surrounded displayed "
         "reading facing leaning floating flying growing shining reflecting").split()
_PREP = "on in near next to under behind beside with at along across above inside over".split()
_CONJ = "and while with where as".split()
_QSTART = [
    "What is", "What color is", "How many", "Where is", "Which", "Why is", "What does",
    "Describe", "Is there", "What kind of", "Who is", "Read the text on", "What is written on",
    "Summarize", "What is the value of", "Explain",
]


def _zipf_pick(rng: np.random.Generator, words: Sequence[str]) -> str:
    # P(rank r) ~ 1/(r+1): a cheap Zipf draw via the inverse CDF of a log-uniform.
    n = len(words)
    r = int(math.exp(rng.random() * math.log(n + 1))) - 1
    return words[min(max(r, 0), n - 1)]


def _sentence_words(rng: np.random.Generator) -> list[str]:
    w = [_zipf_pick(rng, _DET)]
    if rng.random() < 0.6:
        w.append(_zipf_pick(rng, _ADJ))
    w += [_zipf_pick(rng, _NOUN), _zipf_pick(rng, _VERB)]
    for _ in range(int(rng.integers(0, 3))):
        w += [_zipf_pick(rng, _PREP), _zipf_pick(rng, _DET)]
        if rng.random() < 0.4:
            w.append(_zipf_pick(rng, _ADJ))
        w.append(_zipf_pick(rng, _NOUN))
    if rng.random() < 0.3:
        w += [_zipf_pick(rng, _CONJ), _zipf_pick(rng, _DET), _zipf_pick(rng, _NOUN), _zipf_pick(rng, _VERB)]
    return w


def _prose(rng: np.random.Generator, n_words: int) -> str:
    """Exactly ``n_words`` whitespace-separated words in capitalised, full-stopped sentences."""
    out: list[str] = []
    while len(out) < n_words:
        s = _sentence_words(rng)[: n_words - len(out)]
        s[0] = s[0].capitalize()
        s[-1] += "."
        out += s
    return " ".join(out)


def _question(rng: np.random.Generator, n_words: int) -> str:
    start = _QSTART[int(rng.integers(len(_QSTART)))].split()
    words = start[:n_words]
    while len(words) < n_words:
        words += [_zipf_pick(rng, _DET), _zipf_pick(rng, _ADJ), _zipf_pick(rng, _NOUN),
                  _zipf_pick(rng, _PREP)][: n_words - len(words)]
    return " ".join(words) + "?"


def _count_words(text: str) -> int:
    return sum(1 for t in text.split() if t not in _MARKERS)


