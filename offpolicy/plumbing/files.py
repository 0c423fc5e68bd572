"""Files written whole: `write_atomic(path, text)` writes a temporary file beside `path` (named with this process's
id, so that two processes writing the same file never share one) and renames it into place, so a reader sees the old
file or the new one, never a part (a crash mid-write leaves at most a stray `.tmp` file)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
