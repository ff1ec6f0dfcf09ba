"""Where the real traces the tests use live (tests/data/README.md says how each was captured).

Traces the demo also ships are kept once, in profiler_svc/samples; the rest in tests/data."""
from pathlib import Path

import pytest

import profiler_svc

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLES = Path(profiler_svc.__file__).resolve().parent / "samples"
DDP = SAMPLES / "gpt2_ddp"  # a folder of two ranks' traces
SMALL_TRACE = DATA / "llama_bf16_compiled_infer.json.gz"  # 533 events, real H200 capture
_PLACES = (DATA, SAMPLES, DATA / "unseen", DATA / "agent")


def fixture_path(name: str) -> Path:
    """A real trace by name (without .json.gz), wherever it is kept."""
    for place in _PLACES:
        path = place / f"{name}.json.gz"
        if path.exists():
            return path
    raise FileNotFoundError(f"no fixture trace {name!r} in {', '.join(str(p) for p in _PLACES)}")


def gpu_fixtures() -> list[Path]:
    """Every real GPU trace file (one per rank for the DDP folder)."""
    found = [p for place in _PLACES for p in place.glob("*.json.gz")] + sorted(DDP.glob("*.json.gz"))
    return sorted(p for p in found if not p.name.startswith("cpu_"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
