"""Writable-path checks made before any work starts (``spade run --out``, ``$SPADE_CACHE``).

Each check tries what the later write will do (make the folder, create a file in
it) so a read-only file system, a file where a folder should be or a path under a
non-directory fails in a second, with one line naming the path and the fix, not
after a model load or a 35-s conversion.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> check_output_file(d / "sub" / "run.json", what="--out") == d / "sub" / "run.json"
True
>>> check_output_file("/dev/null/x.json", what="--out")   # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
spade.errors.ConfigError: --out /dev/null/x.json: /dev/null is not a directory; ...
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from spade.errors import ConfigError


def _blocking_ancestor(p: Path) -> Path | None:
    """The nearest existing ancestor of ``p`` that is not a directory, if any."""
    for a in p.parents:
        if a.exists() or a.is_symlink():
            return None if a.is_dir() else a
    return None


def _probe_dir(d: Path) -> str | None:
    """Create and delete a file in ``d``; the OS's reason when that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".spade-probe-", dir=d)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(name)
    return None


def check_writable_dir(path: str | os.PathLike, *, what: str, fix: str) -> Path:
    """Make folder ``path`` (with parents) and check a file can be created in it.
    ``what`` names the setting (``SPADE_CACHE=...``), ``fix`` says what to do; both
    go into the ``ConfigError`` raised otherwise."""
    d = Path(path).expanduser()
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{what}: {d} is a file, not a folder; {fix}")
    bad = _blocking_ancestor(d)
    if bad is not None:
        raise ConfigError(f"{what}: cannot make {d}: {bad} is not a directory; {fix}")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what}: cannot make {d}: {e.strerror or e}; {fix}") from None
    why = _probe_dir(d)
    if why is not None:
        raise ConfigError(f"{what}: {d} is not writable ({why}); {fix}")
    return d


def check_output_file(path: str | os.PathLike, *, what: str) -> Path:
    """Check that file ``path`` can be written later: not a folder, not under a
    non-directory, its folder exists (made here if missing) and takes new files, and
    an existing file is writable. Returns the path."""
    p = Path(path).expanduser()
    fix = "give a writable file path, e.g. results/run.json"
    if p.is_dir():
        raise ConfigError(f"{what} {p}: is a directory; give a file path inside it, e.g. {p / 'run.json'}")
    bad = _blocking_ancestor(p)
    if bad is not None:
        raise ConfigError(f"{what} {p}: {bad} is not a directory; {fix}")
    check_writable_dir(p.parent if str(p.parent) else Path("."), what=f"{what} {p}", fix=fix)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{what} {p}: the file exists and is not writable; {fix}")
    return p
