"""Writable-path checks made before work starts (spade.paths)."""

import pytest

from spade.errors import ConfigError
from spade.paths import check_output_file, check_writable_dir


def test_output_file_ok_and_parents_made(tmp_path):
    p = tmp_path / "a" / "b" / "r.json"
    assert check_output_file(p, what="--out") == p
    assert p.parent.is_dir() and not p.exists()  # the folder is made, the file is not
    assert list(p.parent.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("rel, why", [("", "is a directory"), ("f.txt/r.json", "f.txt is not a directory"),
                                      ("f.txt/x/y/r.json", "f.txt is not a directory")])
def test_output_file_refused(tmp_path, rel, why):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ConfigError, match=why):
        check_output_file(tmp_path / rel, what="--out")


def test_output_under_dev_null():
    with pytest.raises(ConfigError, match=r"--out /dev/null/x.json: /dev/null is not a directory"):
        check_output_file("/dev/null/x.json", what="--out")


def test_writable_dir(tmp_path):
    assert check_writable_dir(tmp_path / "c" / "hf", what="SPADE_CACHE", fix="fix it").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"SPADE_CACHE: .*file is a file, not a folder; fix it"):
        check_writable_dir(tmp_path / "file", what="SPADE_CACHE", fix="fix it")
    with pytest.raises(ConfigError, match=r"SPADE_CACHE: cannot make .*: .*file is not a directory; fix it"):
        check_writable_dir(tmp_path / "file" / "hf", what="SPADE_CACHE", fix="fix it")
