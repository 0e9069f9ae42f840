"""The error every reader of checkpoint files raises for a damaged or malformed input (convert/rules.py re-exports it),
and the JSON reader the checkpoint readers share.

`CheckpointError` is a ValueError, so the command lines report it as one line (`error: ...`) and exit 2 rather than
print a traceback; its message names the file and what is wrong in it.
"""

from __future__ import annotations

import json
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint file or folder that cannot be read as what it claims to be: empty, truncated, a header or config
    that does not parse, a required key or tensor missing. The message names the file and what is wrong in it."""


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object stored in `path` (config.json, an index, a marker); a CheckpointError naming the file when it
    does not parse or holds something else than an object. A missing file is FileNotFoundError, as from `open`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as error:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not text
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found a JSON {type(data).__name__}")
    return data
