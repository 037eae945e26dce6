"""Metric and param keys as MLflow names: every key MLflow accepts kept, refused ones replaced, none merged.

MLflow's rule (``mlflow/utils/validation.py``, ``validate_param_and_metric_name``
and ``path_not_unique``): a name holds Unicode word characters (letters of any
script, digits, ``_``), ``/ . -``, spaces and ``:`` (not ``:`` on Windows),
at most 250 of them, and must not read as another path (no leading ``/``, no
empty, ``.`` or ``..`` segment, no trailing ``/``). So ``损失``, ``énergie``
and ``profiling/Time taken: generate`` are logged unchanged.

A key MLflow refuses is logged under a name made of it: each refused character
becomes ``_`` (``learning rate(param group 1)`` → ``learning rate_param group 1_``),
path segments MLflow would resolve become ``_``, and a name over 250
characters is cut. When that name is already another key's (a key that differs
only in refused characters, or an accepted key equal to it: the keys MLflow
accepts are named first within a record, so they keep their names unless a
refused key of an *earlier* record took it), the key gets a
deterministic suffix: ``-`` and the first 8 hex digits of the key's SHA-1
(``a(b)`` and ``a[b]`` → ``a_b_`` and ``a_b_-3c1f0e2a``). Two keys never share a
name, and no key is dropped.

:class:`MlflowNames` keeps the names of one run; the MLflow backend records
the keys whose name differs in the run tag ``twinkle_megatron.key_names``
(JSON ``{"metrics": {name: key}, "params": {name: key}}``) and reloads it when
it reopens the run, so a key keeps its name across restarts.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import sys
from typing import Iterable, Mapping

MAX_NAME_LENGTH = 250  # MLflow's MAX_ENTITY_KEY_LENGTH
_REFUSED = re.compile(r"[^/\w.\- ]" if sys.platform == "win32" else r"[^/\w.\- :]")


def mlflow_accepts(name: str) -> bool:
    """Whether MLflow accepts ``name`` as a metric, param or tag key (its own rule, see the module docstring)."""
    return (0 < len(name) <= MAX_NAME_LENGTH and _REFUSED.search(name) is None
            and not _resolves_elsewhere(name))


def mlflow_key(key: str) -> str:
    """The MLflow name of ``key`` alone: ``key`` when MLflow accepts it, else its refused parts replaced."""
    if mlflow_accepts(key):
        return key
    name = _REFUSED.sub("_", key)[:MAX_NAME_LENGTH]
    if _resolves_elsewhere(name):
        segments = ["_" if segment in ("", ".", "..") else segment for segment in name.split("/")]
        name = "/".join(segments)
        if name.startswith(".."):  # "..loss" reads as a parent path
            name = "_" + name
    if len(name) > MAX_NAME_LENGTH:  # lengthened by the repair: cut, ending on "_" so the last segment is a name
        name = name[:MAX_NAME_LENGTH - 1] + "_"
    return name


class MlflowNames:
    """The MLflow name of each key of one run; two keys never get one name.

    Args:
        held: names the run already holds (its metrics or params): taken by
            themselves, unless ``renamed`` says which key holds them.
        renamed: ``{name: key}`` of keys the run logged under another name
            (the ``twinkle_megatron.key_names`` tag of an earlier attempt).
    """

    def __init__(self, held: Iterable[str] = (), renamed: Mapping[str, str] = ()) -> None:
        self._owner: dict[str, str] = {name: name for name in held}  # name -> key
        self._owner.update(dict(renamed))
        self._names: dict[str, str] = {key: name for name, key in self._owner.items()}  # key -> name

    def __call__(self, key: str) -> str:
        """``key``'s name in this run (the same at every call)."""
        name = self._names.get(key)
        if name is None:
            name = mlflow_key(key)
            if self._owner.get(name, key) != key:
                name = self._suffixed(key, name)
            self._names[key], self._owner[name] = name, key
        return name

    def names(self, keys: Iterable[str]) -> dict[str, str]:
        """``{key: name}`` for keys logged together: the keys MLflow accepts are named first, so that a
        refused key of the same record never takes an accepted key's own name."""
        keys = list(keys)
        for key in sorted(keys, key=lambda key: not mlflow_accepts(key)):  # stable: accepted first
            self(key)
        return {key: self._names[key] for key in keys}

    @property
    def renamed(self) -> dict[str, str]:
        """``{name: key}`` of the keys whose MLflow name is not the key itself."""
        return {name: key for name, key in self._owner.items() if name != key}

    def _suffixed(self, key: str, name: str) -> str:
        digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()
        for length in (8, 16, 40):
            suffix = f"-{digest[:length]}"
            candidate = name[:MAX_NAME_LENGTH - len(suffix)] + suffix
            if self._owner.get(candidate, key) == key:
                return candidate
        number = 2
        while True:  # 40 hex digits taken by another key: practically never
            suffix = f"-{digest}-{number}"
            candidate = name[:MAX_NAME_LENGTH - len(suffix)] + suffix
            if self._owner.get(candidate, key) == key:
                return candidate
            number += 1


def _resolves_elsewhere(name: str) -> bool:
    """MLflow's ``path_not_unique``: the name, read as a path, is not itself."""
    normal = posixpath.normpath(name)
    return normal != name or normal == "." or normal.startswith("..") or normal.startswith("/")
