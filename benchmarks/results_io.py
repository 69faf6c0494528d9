"""The GPU check's result files: written whole or not at all, read without trusting them.

A part of benchmarks/gpu_check.sh can be killed at its time limit at any moment, a write included.
`write_json` writes a temporary file beside the target and renames it over the target (a rename on
one file system is atomic), so a reader sees the previous complete file or the new one, never half of
one. `read_json` returns the parsed file, or None and a one-line reason when it is missing or torn.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: Path, data) -> None:
    """Write `data` as JSON to `path` atomically: a temporary file in the same folder, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1, default=str)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read_json(path: Path) -> tuple[object | None, str]:
    """(the parsed JSON, "") or (None, why it could not be read: missing, torn or not JSON)."""
    try:
        return json.loads(Path(path).read_text()), ""
    except FileNotFoundError:
        return None, f"{path} was not written"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{path} is unreadable (torn by a kill?): {error}"[:300]
