"""Files written with the permissions of ordinary files.

safetensors (0.8) writes every ``.safetensors`` file as 0600 whatever the umask, so a saved model is readable by
its owner only: a shared checkpoint folder, a model served by another user or copied into a container then
fails to load. The writers of hf_spectral give what they save the permissions ``open()`` and ``mkdir`` give
under the current umask.
"""

from __future__ import annotations

import os
import stat


def make_folders(path: str) -> str | None:
    """``os.makedirs(path, exist_ok=True)``; returns the outermost folder it created (``None`` if ``path`` existed),
    which removes again everything the call made, for a writer that fails before its output is complete."""
    created, missing = None, os.path.abspath(path)
    while not os.path.exists(missing):
        created, missing = missing, os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    return created


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    return mask


def apply_umask(path: str) -> None:
    """Set ``path`` — a file, or a folder and everything under it — to 0666 (files) / 0777 (folders) less the
    umask. Symbolic links are left alone."""
    mask = current_umask()
    file_mode, folder_mode = 0o666 & ~mask, 0o777 & ~mask

    def fix(target: str) -> None:
        mode = os.lstat(target).st_mode
        if stat.S_ISLNK(mode):
            return
        wanted = folder_mode if stat.S_ISDIR(mode) else file_mode
        if stat.S_IMODE(mode) != wanted:
            os.chmod(target, wanted)

    fix(path)
    if os.path.isdir(path) and not os.path.islink(path):
        for folder, folders, files in os.walk(path):
            for name in folders + files:
                fix(os.path.join(folder, name))
