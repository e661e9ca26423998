"""Keras variable paths as the NNX state keys of a Keras model in `mirrax.Model`, and how a
checkpoint whose keys are not the model's own still finds each variable.

A Keras model's variables are stored under their Keras paths split at "/"
(state["variables"]["dense"]["kernel"]), made unique (`state_keys`). A checkpoint keyed
otherwise is matched variable for variable (`checkpoint_aliases`), never by shape alone:

- one written while mirrax keyed them by position ("variables/<i>" in `keras_model.variables`
  order, "seed_counts/<j>" per seed state): variable i is the model's i-th;
- one written by the same model built earlier in the process, whose auto-named layers Keras
  numbered further on ("sequential_3/dense_7/kernel" where the model now has
  "sequential_4/dense_9/kernel"): the names are compared with each name's number replaced by
  its rank among the numbers of that base name in the model ("dense", "dense_7", "dense_8" ->
  dense#0, dense#1, dense#2), so the same code building the same layers matches.
"""

from __future__ import annotations

import re

_NUMBERED = re.compile(r"(.*?)(?:_(\d+))?")


def state_keys(paths) -> tuple:
    """Each Keras variable path as the keys its NNX variable is stored under: the path's "/"
    segments ("dense/kernel" -> ("dense", "kernel"), so state["variables"]["dense"]["kernel"]).

    Keras's paths are not always unique (two layers of a subclassed model given one name share
    "model/same/kernel"), and a path can also name a variable where another path has more
    segments below it. So, in `keras_model.variables` order, a segment that would repeat an
    earlier variable's keys, or clash with them that way, becomes its first free
    f"{segment}_{n}" (n = 1, 2, ...): the second "model/same/kernel" is "model/same/kernel_1".
    """
    leaves: set[tuple] = set()
    inner: set[tuple] = set()
    out: list[tuple] = []
    for path in paths:
        keys = str(path).split("/")
        for j in range(len(keys)):
            base, n = keys[j], 0
            while tuple(keys[: j + 1]) in leaves or (j == len(keys) - 1 and tuple(keys) in inner):
                n += 1
                keys[j] = f"{base}_{n}"
        key = tuple(keys)
        leaves.add(key)
        inner.update(key[:j] for j in range(1, len(key)))
        out.append(key)
    return tuple(out)


def _canonical(keys) -> dict:
    """{key: the key with each segment's number replaced by its rank within its base name}."""
    by_base: dict = {}
    for segment in {segment for key in keys for segment in key}:
        match = _NUMBERED.fullmatch(segment)
        assert match is not None  # the pattern matches every string
        base, number = match.groups()
        by_base.setdefault(base, []).append((int(number or 0), segment))
    rank = {
        segment: f"{base}#{i}"
        for base, numbered in by_base.items()
        for i, (_, segment) in enumerate(sorted(numbered))
    }
    return {key: tuple(rank[segment] for segment in key) for key in keys}


def _stored_keys(stored_paths) -> dict:
    """{"variables" / "seed_counts": the module keys the stored paths end with} (each path's
    part after the last "variables" or "seed_counts": the module's own, or an optimizer's)."""
    found: dict = {"variables": set(), "seed_counts": set()}
    for path in stored_paths:
        path = tuple(str(key) for key in path)
        for where in found:
            if where in path:
                last = len(path) - 1 - path[::-1].index(where)
                found[where].add(path[last + 1 :])
    return found


def checkpoint_aliases(keys: tuple, is_seed: tuple, stored_paths):
    """For a checkpoint whose paths (`stored_paths`, tuples of str) are not the module's own: a
    function taking a state path of the module (or one that ends with one, as an optimizer's
    state does) to the path the checkpoint holds that value under (None: not a variable's);
    None when the checkpoint's variables do not correspond one to one (see the module doc)."""
    stored = _stored_keys(stored_paths)
    seeds = [key for key, seed in zip(keys, is_seed) if seed]
    if stored["variables"] and all(len(k) == 1 and k[0].isdigit() for k in stored["variables"]):
        own = {("variables",) + key: ("variables", str(i)) for i, key in enumerate(keys)}
        own.update({("seed_counts",) + key: ("seed_counts", str(j)) for j, key in enumerate(seeds)})
    else:
        own = {}
        for where, mine in (("variables", keys), ("seed_counts", seeds)):
            theirs = {c: key for key, c in _canonical(stored[where]).items()}
            for key, c in _canonical(mine).items():
                if c not in theirs or len(theirs) != len(mine):
                    return None
                own[(where,) + key] = (where,) + theirs[c]
    lengths = sorted({len(path) for path in own})

    def alias(path: tuple):
        path = tuple(path)
        for length in lengths:
            tail = path[-length:]
            if tail in own:
                return path[:-length] + own[tail]
        return None

    return alias
