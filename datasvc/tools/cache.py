"""The one cache directory the tools write to (bench inputs, soak shards): ``$VLMFEED_CACHE``,
else ``~/.cache/vlmfeed``."""
from __future__ import annotations

import os
from typing import Callable


def cache_dir(*parts: str) -> str:
    """A path under the cache root."""
    root = os.environ.get("VLMFEED_CACHE", os.path.expanduser("~/.cache/vlmfeed"))
    return os.path.join(root, *parts)


def cached_tars(name: str, write: Callable[[str], object]) -> list[str]:
    """The ``*.tar`` files of cache directory ``name``, written by ``write(directory)`` the first
    time. A marker file is written last, so a run cut short is redone rather than half used."""
    out = cache_dir(name)
    done = os.path.join(out, ".complete")
    if not os.path.exists(done):
        write(out)
        open(done, "w").close()
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))
