"""The phase data every test of the model package collates its batches with."""

from __future__ import annotations

import pytest

from pretrain.data.batches import PhaseData
from tests.support.model_fixtures import tiny_phase_data


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> PhaseData:
    return tiny_phase_data(tmp_path_factory.mktemp("model") / "data")
