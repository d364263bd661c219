"""The filesystem exchange trusts only group folders that are this user's alone, and only finite weights: whoever
can write a group's folder publishes its teacher, and a NaN teacher makes every student's loss NaN. In one
process, with real files, permissions and owners (the owner test needs root to hand a folder to another uid)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from pretrain.codistill.exchange import (
    ExchangeFolderError,
    FileExchange,
    GroupComm,
    TeacherWeightsError,
    publish,
    published_step,
    read_published,
)
from pretrain.codistill.teacher import load_flat
from pretrain.errors import ConfigError, DataError

CPU = torch.device("cpu")
NOBODY = 65534


def reader(root: Path) -> FileExchange:
    return FileExchange(root, 0, [1], GroupComm(size=1, first_rank=0, group=None, device=CPU), is_first=True)


def test_a_group_folder_is_created_for_this_user_alone_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)  # a cluster's usual umask with user private groups: group-writable by default
    try:
        publish(tmp_path / "shared" / "group0", 4, torch.ones(3))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared" / "group0").stat().st_mode) == 0o755
    assert published_step(tmp_path / "shared" / "group0") == 4


@pytest.mark.parametrize(("mode", "who"), [(0o775, "its group"), (0o777, "others"), (0o1777, "others")])
def test_a_group_folder_others_can_write_is_neither_written_nor_read(tmp_path: Path, mode: int, who: str) -> None:
    folder = tmp_path / "group1"
    publish(folder, 2, torch.ones(2))  # published as ours, then opened up (or created so by someone first)
    folder.chmod(mode)
    line = (f"codistill.exchange_dir: {folder} is writable by {who} (mode {mode:o}): they could publish this "
            f"group's weights; `chmod go-w {folder}` if that is yours alone")
    for use in (lambda: publish(folder, 3, torch.ones(2)), lambda: read_published(folder),
                lambda: reader(tmp_path).fetch({1: torch.nn.Linear(1, 1)}, load_flat)):
        with pytest.raises(ConfigError) as err:
            use()
        assert str(err.value) == line
    assert published_step(folder.with_name("group7")) is None  # a group that has published nothing: fine


def test_a_folder_someone_else_created_first_is_not_adopted(tmp_path: Path) -> None:
    folder = tmp_path / "group0"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # prepared by another user before this job's first publish
    with pytest.raises(ExchangeFolderError, match="writable by others"):
        publish(folder, 1, torch.ones(2))
    assert list(folder.iterdir()) == []
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    link = tmp_path / "group2"
    link.symlink_to(elsewhere)
    with pytest.raises(ExchangeFolderError, match="group2 is not a folder but a link"):
        publish(link, 1, torch.ones(2))
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a folder to another uid needs root")
def test_a_group_folder_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "group1"
    publish(folder, 5, torch.ones(2))
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(ExchangeFolderError) as err:
        read_published(folder)
    assert str(err.value).startswith(f"codistill.exchange_dir: {folder} belongs to uid {NOBODY}, not to you (uid 0)")
    with pytest.raises(ExchangeFolderError):
        publish(folder, 6, torch.ones(2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_teacher_weights_are_refused_naming_the_file(tmp_path: Path, bad: float) -> None:
    weights = torch.arange(6, dtype=torch.float32)
    weights[4] = bad
    publish(tmp_path / "group1", 8, weights)
    teacher = torch.nn.Linear(2, 2)
    before = teacher.weight.detach().clone()
    with pytest.raises(DataError) as err:
        reader(tmp_path).fetch({1: teacher}, load_flat)
    assert str(err.value) == (f"{tmp_path / 'group1' / 'weights-step00000008.pt'}: 1 of the 6 published weights are "
                              "NaN or inf: that group diverged (or the file is not its own); no student learns from it")
    assert torch.equal(teacher.weight, before)
    publish(tmp_path / "group1", 9, torch.arange(6, dtype=torch.bfloat16))  # finite again: taken
    assert reader(tmp_path).fetch({1: teacher}, load_flat) == {1: 9}


def test_a_payload_without_weights_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "group1"
    publish(folder, 1, torch.ones(2))
    torch.save({"step": 1, "flat": torch.ones(2, dtype=torch.int64)}, folder / "weights-step00000001.pt")
    with pytest.raises(TeacherWeightsError, match="holds no floating-point weights"):
        read_published(folder)
