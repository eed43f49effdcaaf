"""Files written with the permissions of ordinary files.

safetensors (0.8) writes every ``.safetensors`` file as 0600 whatever the umask, so a saved model is readable by
its owner only: a shared checkpoint folder, a model served by another user or copied into a container then
fails to load. The writers of hf_spectral give what they save the permissions ``open()`` and ``mkdir`` give
under the current umask, and only what they save: the other files of a folder keep theirs.
"""

from __future__ import annotations

import contextlib
import os
import stat

_PROC_STATUS = "/proc/self/status"  # Linux 4.7 on: a line "Umask:\t0022"


def make_folders(path: str) -> str | None:
    """``os.makedirs(path, exist_ok=True)``; returns the outermost folder it created (``None`` if ``path`` existed),
    which removes again everything the call made, for a writer that fails before its output is complete."""
    created, missing = None, os.path.abspath(path)
    while not os.path.exists(missing):
        created, missing = missing, os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    return created


def current_umask() -> int:
    """The process's umask, read without changing it where the system shows it (Linux: /proc/self/status).
    Elsewhere the only way to read it is to set it (``os.umask`` returns the old value) and set it back; the umask
    belongs to the process, so a file another thread creates in that moment gets the temporary mask, which is
    therefore the strictest one (never a wider mode than that thread asked for)."""
    try:
        with open(_PROC_STATUS) as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(*paths: str) -> None:
    """Set each of ``paths`` — a file, or a folder and everything under it — to 0666 (files) / 0777 (folders) less
    the umask. Pass only what a save wrote (a folder only where all it holds is new): other files keep their mode.
    Symbolic links are left alone."""
    mask = current_umask()
    file_mode, folder_mode = 0o666 & ~mask, 0o777 & ~mask

    def fix(target: str) -> None:
        mode = os.lstat(target).st_mode
        if stat.S_ISLNK(mode):
            return
        wanted = folder_mode if stat.S_ISDIR(mode) else file_mode
        if stat.S_IMODE(mode) != wanted:
            os.chmod(target, wanted)

    for path in paths:
        fix(path)
        if os.path.isdir(path) and not os.path.islink(path):
            for folder, folders, files in os.walk(path):
                for name in folders + files:
                    fix(os.path.join(folder, name))


def _written_stamps(folder: str) -> dict:
    """(inode, modification time) of every file under ``folder``, and ``None`` for every folder: a folder counts as
    written only where it is new (adding a file changes a folder's time too)."""
    stamps = {}
    for parent, folders, files in os.walk(folder):
        for name in folders:
            stamps[os.path.join(parent, name)] = None
        for name in files:
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):  # removed meanwhile
                info = os.lstat(path)
                stamps[path] = (info.st_ino, info.st_mtime_ns)
    return stamps


@contextlib.contextmanager
def umask_permissions_for_what_is_written(folder: str):
    """Give what the block writes under ``folder`` (new files and folders, files replaced or rewritten) the umask's
    permissions (`apply_umask`), for a save into a folder that holds other files: those keep their mode."""
    before = _written_stamps(folder) if os.path.isdir(folder) else {}
    yield
    if os.path.isdir(folder):
        after = _written_stamps(folder)
        apply_umask(*(path for path, stamp in after.items() if path not in before or before[path] != stamp))
