"""The library's source in the key of torch.compile's disk caches (issue 40).

AOTAutograd's cache keys a graph on the graph dynamo hands it, where each of this library's ops
is one call by name: the op's Python backward, the body it inlines (``_compat.custom_op(inline=
True)``), its fake impl and kernels are not in that key. Without more, two versions of this
package on one cache directory (torch's default: ``/tmp/torchinductor_<user>``) shared the
artifacts, and after an upgrade a compiled step ran the old backward: a silently wrong gradient.
(Inductor's FX graph cache keys on the graph AOTAutograd traced, bodies and backward included,
and was right; the AOTAutograd hit skips it.)

torch's knob for it is ``torch.compiler.config.cache_key_tag`` (environment variable
``TORCH_COMPILE_CACHE_KEY_TAG``; torch 2.11 - 2.13): a string hashed into the key of both
caches (and of PGO's profiles and the autotune cache). Importing the package appends
``alltoall_ops=<hash of every .py file of the package>`` to it, keeping a tag you set before the
import, so an unchanged install keeps its warm cache and any change to the package's code misses
it. A tag assigned after the import replaces it: append to it instead
(``torch.compiler.config.cache_key_tag += "|mine"``).

The ranks of a node share that cache directory, and a graph's key does not see the rank: where
an op's fake outputs depend on it (``seq_to_head`` / ``head_to_seq`` over a process group with
heads that W does not divide), rank 1 loaded rank 0's compiled graph and failed its size
assertions. Such fakes call :func:`key_on_rank`, which adds the process's rank to the tag.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Callable

PREFIX = "alltoall_ops="


def source_hash() -> str:
    """sha256 (first 16 hex digits) of the package's ``.py`` files: their paths relative to the
    package and their bytes, in path order (about 1 ms for the package's 0.4 MB)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


TAG = PREFIX + source_hash()
"""This copy's part of ``torch.compiler.config.cache_key_tag``."""


def _appended(current: str, part: str, replaces: Callable[[str], bool]) -> str:
    """``current`` (a ``|``-separated cache-key tag) with ``part`` appended in place of the parts
    ``replaces`` matches."""
    return "|".join([*(p for p in current.split("|") if p and not replaces(p)), part])


def with_tag(current: str) -> str:
    """``current`` (a cache-key tag) with this copy's :data:`TAG` appended (``|``-separated), in
    place of another copy's (a reload) and at most once."""
    return _appended(current, TAG, lambda p: re.fullmatch(re.escape(PREFIX) + "[0-9a-f]+", p) is not None)


RANK_PREFIX = "rank="


def key_on_rank(rank: int) -> None:
    """From now on, key this process's compiled graphs on its ``rank`` too (``rank=<r>`` in
    ``torch.compiler.config.cache_key_tag``, once): called by fake impls whose output shapes
    depend on the rank, while the graph is traced, before its cache key is computed."""
    import torch.compiler.config as cconfig

    part = f"{RANK_PREFIX}{rank}"
    if part not in cconfig.cache_key_tag.split("|"):  # NB: once, so that a later "|mine" stays after it
        cconfig.cache_key_tag = _appended(cconfig.cache_key_tag, part, lambda p: p.startswith(RANK_PREFIX))


def install() -> None:
    """Append :data:`TAG` to ``torch.compiler.config.cache_key_tag`` (a warning where this torch
    has no such knob: its disk caches may then serve another version's graphs)."""
    import torch.compiler.config as cconfig

    if not hasattr(cconfig, "cache_key_tag"):  # pragma: no cover - torch 2.11 - 2.13 have it
        logging.getLogger("alltoall_ops").warning(
            "torch.compiler.config has no cache_key_tag: torch.compile's disk caches do not see this "
            "package's version; after an upgrade, clear them (TORCHINDUCTOR_CACHE_DIR)")
        return
    cconfig.cache_key_tag = with_tag(cconfig.cache_key_tag)


install()
