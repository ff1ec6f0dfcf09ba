"""Shared test fixtures: paths to the real-GPU traces under tests/data (see tests/data/README.md)."""
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


def fixture_path(name: str) -> Path:
    path = DATA / f"{name}.json.gz"
    assert path.exists(), path
    return path
