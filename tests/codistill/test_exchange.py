"""The filesystem exchange of codistillation in one process: publish, prune, read, wait, fetch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pretrain.codistill.exchange import FileExchange, GroupComm, publish, published_step, read_published
from pretrain.codistill.teacher import load_flat

CPU = torch.device("cpu")


def exchange(root: Path, group: int, others: list[int]) -> FileExchange:
    return FileExchange(root, group, others, GroupComm(size=1, first_rank=0, group=None, device=CPU), is_first=True)


def test_publish_keeps_the_newest_two_and_latest_names_the_newest(tmp_path: Path) -> None:
    folder = tmp_path / "group0"
    assert published_step(folder) is None and read_published(folder) is None
    for step in (4, 8, 12):
        publish(folder, step, torch.full((5,), float(step)))
    assert sorted(p.name for p in folder.glob("weights-step*.pt")) == ["weights-step00000008.pt",
                                                                      "weights-step00000012.pt"]
    assert published_step(folder) == 12
    step, flat = read_published(folder)
    assert step == 12 and torch.equal(flat, torch.full((5,), 12.0))
    (folder / "latest").write_text("model.bin")
    with pytest.raises(ValueError, match="not a weights-stepNNNNNNNN.pt file"):
        published_step(folder)


def test_fetch_loads_each_other_groups_newest_weights_into_its_teacher(tmp_path: Path) -> None:
    teachers = {1: torch.nn.Linear(3, 2), 2: torch.nn.Linear(3, 2)}
    mine = exchange(tmp_path, 0, [1, 2])
    assert mine.fetch(teachers, load_flat) == {}  # nobody has published: teachers untouched, none reported
    publish(tmp_path / "group1", 6, torch.arange(8, dtype=torch.float32))
    found = mine.fetch(teachers, load_flat)
    assert found == {1: 6}
    assert torch.equal(teachers[1].weight.reshape(-1), torch.arange(6, dtype=torch.float32))
    publish(tmp_path / "group2", 3, torch.zeros(5))
    with pytest.raises(ValueError, match="5 weights published, this model has 8"):
        mine.fetch(teachers, load_flat)


def test_wait_returns_when_the_others_reach_the_step_or_gives_up(tmp_path: Path) -> None:
    mine = exchange(tmp_path, 0, [1])
    started = time.monotonic()
    assert mine.wait({1: 0}, timeout_s=0.6) is False  # nothing published: gives up after the timeout
    assert time.monotonic() - started >= 0.6  # it did wait the whole timeout
    publish(tmp_path / "group1", 4, torch.zeros(2))
    assert mine.wait({1: 0}, timeout_s=0.0) is True
    assert mine.wait({1: 10}, timeout_s=0.0) is False  # only step 4 so far
    later = threading.Timer(0.7, lambda: publish(tmp_path / "group1", 10, torch.zeros(2)))
    later.start()
    try:
        assert mine.wait({1: 10}, timeout_s=30.0) is True  # another job publishes its final step meanwhile
    finally:
        later.join()
