"""What the standing fuzzers share: an empty corpus (the first positional argument, a folder)
seeded with a fuzzer's own inputs before libFuzzer starts, so its first runs begin from them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable


def seed_empty_corpus(seeds: Iterable[bytes]) -> None:
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus and os.path.isdir(corpus) and not os.listdir(corpus):
        for i, seed in enumerate(seeds):
            with open(os.path.join(corpus, f"seed-{i:02d}"), "wb") as f:
                f.write(seed)
