"""offpolicy/plumbing/files.py: a file written whole or not at all."""

from __future__ import annotations

import pytest

from offpolicy.plumbing import files
from offpolicy.plumbing.files import write_atomic


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_atomic(path, "old\n")
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", refused)  # the rename fails after the temporary file was written
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "newer\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
