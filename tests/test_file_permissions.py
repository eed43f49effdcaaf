"""Saved files get the umask's permissions, and only they: the umask is read without being changed, and the other
files of a folder a save writes into keep their modes."""

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from hf_spectral import file_permissions
from hf_spectral.file_permissions import apply_umask, current_umask, umask_permissions_for_what_is_written


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield 0o027
    os.umask(previous)


def test_the_umask_is_read_without_setting_it(umask_027, monkeypatch):
    """Setting the umask, even for a moment, would give the files another thread creates meanwhile the wrong mode."""

    def no_umask_calls(mask):
        raise AssertionError(f"os.umask({mask:o}) called")

    monkeypatch.setattr(file_permissions.os, "umask", no_umask_calls)
    assert current_umask() == umask_027


def test_where_the_system_does_not_show_the_umask_it_is_read_by_setting_and_restoring_it(umask_027, monkeypatch):
    masks_set = []
    umask = os.umask

    def recording_umask(mask):
        masks_set.append(mask)
        return umask(mask)

    monkeypatch.setattr(file_permissions, "_PROC_STATUS", "/nonexistent/status")
    monkeypatch.setattr(file_permissions.os, "umask", recording_umask)
    assert current_umask() == umask_027
    assert masks_set == [0o077, umask_027]  # the temporary mask is the strictest one, then the umask as it was
    assert umask(umask_027) == umask_027


def test_a_save_gives_what_it_writes_the_umasks_modes_and_leaves_the_other_files_alone(umask_027, tmp_path):
    folder = tmp_path / "run"
    (folder / "kept").mkdir(parents=True)
    for name, mode in (("notes.txt", 0o600), ("script.sh", 0o750), ("model.safetensors", 0o640)):
        (folder / name).write_text("old")
        os.chmod(folder / name, mode)
    os.chmod(folder / "kept", 0o700)
    os.chmod(folder, 0o700)
    with umask_permissions_for_what_is_written(str(folder)):
        save_file({"weight": torch.ones(2)}, str(folder / "model.safetensors"))  # replaced: 0600 whatever the umask
        save_file({"weight": torch.ones(2)}, str(folder / "new.safetensors"))
        (folder / "sub").mkdir()
        save_file({"weight": torch.ones(2)}, str(folder / "sub" / "adapter.safetensors"))
    assert {name: _mode(folder / name) for name in ("notes.txt", "script.sh", "kept", ".")} == {
        "notes.txt": 0o600, "script.sh": 0o750, "kept": 0o700, ".": 0o700}
    assert {name: _mode(folder / name) for name in ("model.safetensors", "new.safetensors", "sub",
                                                    "sub/adapter.safetensors")} == {
        "model.safetensors": 0o640, "new.safetensors": 0o640, "sub": 0o750, "sub/adapter.safetensors": 0o640}


def test_apply_umask_sets_only_the_paths_it_is_given(umask_027, tmp_path):
    for name in ("written", "other"):
        (tmp_path / name).write_text(name)
        os.chmod(tmp_path / name, 0o600)
    (tmp_path / "link").symlink_to(tmp_path / "other")
    apply_umask(str(tmp_path / "written"), str(tmp_path / "link"))
    assert (_mode(tmp_path / "written"), _mode(tmp_path / "other")) == (0o640, 0o600)
