"""The JSON-lines files the engines write (``tokens-<pid>.jsonl``, ``kv-<pid>.jsonl``), found
under folders, inside ``.tar.gz`` packs of them, or named directly."""

from __future__ import annotations

import os
import tarfile
from typing import Iterable, Iterator


def files(paths: Iterable[str], prefix: str, suffix: str = ".jsonl") -> Iterator[tuple[str, list[str]]]:
    """(name, lines) of every ``<prefix>*<suffix>`` file under each path: a folder (walked,
    in name order), a ``.tar.gz`` pack, or a file (read whatever its name).
    FileNotFoundError for a path that is none of them."""
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                for f in sorted(names):
                    if f.startswith(prefix) and f.endswith(suffix):
                        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                            yield os.path.join(root, f), fh.read().splitlines()
        elif p.endswith((".tar.gz", ".tgz")) and os.path.isfile(p):
            with tarfile.open(p) as tar:
                for m in tar.getmembers():
                    base = os.path.basename(m.name)
                    if m.isfile() and base.startswith(prefix) and base.endswith(suffix):
                        fh = tar.extractfile(m)
                        if fh is not None:
                            yield f"{p}:{m.name}", fh.read().decode("utf-8", "replace").splitlines()
        elif os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as fh:
                yield p, fh.read().splitlines()
        else:
            raise FileNotFoundError(f"{p}: not a folder, a .tar.gz or a file of {prefix}*{suffix} lines")
