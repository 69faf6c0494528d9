"""Configs, traces and parameter lists kept on disk between runs of `course-lib plan` (lesson 1, "the
planner"). Each kind's reader and writer live with its type: `models.cached_params`,
`planner.trace.step.cached_trace`, `model_config.read_config`.

A trace depends only on the config, the setup's traced fields, the target, the libraries that run it
and the tracer's own code; a parameter list only on the config and the libraries; a config
(model_config.SavedConfig) on the file it was read from. All of them are in the key
(`planner.trace.model.trace_key`, the config's JSON or the file's contents, the torch, transformers and peft
versions, a digest of course_lib's sources), so a changed file, library or course_lib never reads an
old entry. A second `course-lib plan` of a bundled model or a config.json in a setup it planned
before (each trick of "what makes it fit" is one) imports neither transformers nor peft, builds no
model and traces nothing (whether the model's class supports SDPA is kept too). `COURSE_LIB_CACHE_DIR` moves the cache (default `~/.cache/course-lib/traces`);
set it empty to switch it off.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Hashable
from functools import lru_cache
from importlib import metadata
from pathlib import Path


def cache_dir() -> Path | None:
    """Where traces are kept, or None when the cache is off."""
    value = os.environ.get("COURSE_LIB_CACHE_DIR")
    if value is None:
        return Path.home() / ".cache" / "course-lib" / "traces"
    return Path(value).expanduser() if value else None


@lru_cache(maxsize=1)
def _fingerprint() -> str:
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):  # course_lib's code: the trace runs the tracker, the toolbox, ...
        digest.update(source.read_bytes())
    for package in ("torch", "transformers", "peft"):
        try:
            digest.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none".encode())
    return digest.hexdigest()


_MEMO: dict[tuple, object] = {}


def memo(kind: str, key: Hashable, make: Callable):
    """`make()` kept for the process under (kind, key) and the cache's folder: the one in-process cache,
    for what the later stages of a request and the fit search's candidates ask again (a trace, an allocation
    stream, a slack). Keyed as the disk cache is, so a value never outlives what it was made from."""
    where = (str(cache_dir()), kind, key)
    if where not in _MEMO:
        _MEMO[where] = make()
    return _MEMO[where]


def clear_memo() -> None:
    """Forget what `memo` kept (a test's or a benchmark's cold start; the disk cache stays)."""
    _MEMO.clear()


def cached(kind: str, key: str, make: Callable, to_json: Callable, from_json: Callable):
    """`from_json` of what is kept on disk for (kind, key), or `make()` kept there as `to_json` of it; either
    kept in the process too (`memo`)."""
    return memo(kind, key, lambda: _on_disk(kind, key, make, to_json, from_json))


def _on_disk(kind: str, key: str, make: Callable, to_json: Callable, from_json: Callable):
    folder = cache_dir()
    if folder is None:
        return make()
    path = folder / f"{kind}-{hashlib.sha256((_fingerprint() + key).encode()).hexdigest()}.json"
    try:
        return from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    value = make()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(to_json(value)))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home: plan without the cache
    return value


def cached_answer(kind: str, key: str, make: Callable):
    """A plain JSON value (e.g. whether a model class supports SDPA) from disk, or `make()` stored."""
    return cached(kind, key, make, lambda value: value, lambda value: value)
