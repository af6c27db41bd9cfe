"""Files inside a job's output or checkpoint folder, touched without following a link out of it.

An output folder is the job's own: everything dask-lm opens, writes, renames or deletes there is an entry of that
folder, never what a symbolic link planted in it points to. A link under a name the job owns (the lock,
``_manifest.json``, ``_SUCCESS``, a part, ``_errors/``, a ``step_N`` checkpoint) would otherwise turn a write,
a truncation or a delete into one on a file elsewhere (``ln -s ~/victim out/.dask-lm.lock`` made a run overwrite
``~/victim``). So:

- files are opened with ``O_NOFOLLOW`` (:func:`open_no_follow`), and new ones with ``O_EXCL`` too
  (:func:`create_new`): a link is refused, naming it, rather than followed;
- directories the job writes into are real directories (:func:`own_dir`), never a link to one;
- an entry is removed as what it is (:func:`remove`): a link is unlinked (its target stays), a directory is
  removed by ``shutil.rmtree``'s descriptor-based walk, which unlinks the links inside it and never descends
  through one;
- :func:`refuse_link` turns a link found where the job's own file belongs into a ``ValueError`` naming it and
  saying what to do.

The output folder itself may be a link (``--output`` names where the job writes; a link there is the user's
choice). Renames (``os.replace``) act on the entry, not on a link's target, so they need nothing here. Nothing
here touches a model or CUDA.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import IO

from dask_lm.interface import opt

__all__ = ["NOFOLLOW", "is_link", "link_error", "refuse_link", "open_no_follow", "create_new", "own_dir", "remove"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, where creating a link needs a privilege anyway


def is_link(path: str) -> bool:
    """Whether ``path`` itself is a symbolic link (the link, not its target, is looked at)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def link_error(path: str) -> ValueError:
    """The refusal of a link found where a job's own file belongs."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return ValueError(
        f"{path} is a symbolic link{target}; dask-lm never follows a link inside an output folder (it "
        f"would write or delete what the link points to): remove the link ({path}), or choose another "
        f"{opt('output')}"
    )


def refuse_link(path: str) -> None:
    """``ValueError`` naming ``path`` when it is a symbolic link."""
    if is_link(path):
        raise link_error(path)


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses (``ValueError`` naming it) a symbolic link at ``path`` instead of following it, and
    anything but a regular file there (a FIFO or a device under a job's file name is not the job's)."""
    try:
        fd = os.open(path, flags | NOFOLLOW, mode)
    except OSError as e:
        # ELOOP is Linux's answer to O_NOFOLLOW on a link; some BSDs answer EMLINK, FreeBSD EFTYPE
        if e.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)) and is_link(path):
            raise link_error(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(
            f"{path} is not a regular file; dask-lm writes only its own files in an output folder: "
            f"remove it, or choose another {opt('output')}"
        )
    return fd


def create_new(path: str, mode: int = 0o644) -> IO[bytes]:
    """A new file at ``path`` (a fresh temporary name), opened for binary reading and writing (a part's proof is
    patched into its footer through the same descriptor): never an existing file, never through a link
    (``O_CREAT | O_EXCL``, which fails on any entry already there, a dangling link included)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
    return os.fdopen(fd, "w+b")


def own_dir(path: str) -> str:
    """Make ``path`` a directory if it is missing; ``ValueError`` naming it when it is a link or not a directory
    (the job would write into the link's target, or fail later). Returns ``path``."""
    try:
        os.mkdir(path)
        return path
    except FileExistsError:
        pass
    refuse_link(path)
    if not os.path.isdir(path):
        raise ValueError(
            f"{path} is not a directory, and dask-lm keeps its own files there: remove it, or choose "
            f"another {opt('output')}"
        )
    return path


def remove(path: str) -> bool:
    """Remove the entry ``path`` as what it is: a link is unlinked (its target stays), a directory removed with
    everything inside it (links inside unlinked, never followed), a file unlinked. Returns whether something was
    there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        # the fd-based walk (openat / unlinkat): a link inside is unlinked, a directory swapped for a link while
        # it runs is refused, so nothing outside ``path`` is ever deleted
        assert shutil.rmtree.avoids_symlink_attacks, "this platform's shutil.rmtree may follow links"
        shutil.rmtree(path, onerror=_gone_is_fine)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
    return True


def _gone_is_fine(func: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):  # removed meanwhile: what was wanted
        raise exc_info[1]
