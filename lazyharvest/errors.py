"""The one exception type every harvest error is raised as."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HarvestError(ValueError):
    """A harvest was given a program or input it cannot handle.

    The message names the tag and the site and says what to do instead.
    """


def closest(word: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    cands = list(candidates)
    return difflib.get_close_matches(word, cands, n=n, cutoff=0.3) or cands[:n]
