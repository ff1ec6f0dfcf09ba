"""Where the real traces the tests use live (tests/data/README.md says how each was captured).

Traces the demo also ships are kept once, in profiler_svc/samples; the rest in tests/data."""
import gzip
import json
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


def fixture_dir(name: str) -> Path:
    """A folder of one job's per-rank traces, by name."""
    for place in _PLACES:
        if (place / name).is_dir():
            return place / name
    raise FileNotFoundError(f"no fixture folder {name!r} in {', '.join(str(p) for p in _PLACES)}")


def gpu_fixtures() -> list[Path]:
    """Every real GPU trace file (each rank of the per-rank folders too)."""
    found = [p for place in _PLACES for p in place.glob("*.json.gz")]
    found += [p for place in _PLACES for folder in place.iterdir() if folder.is_dir() for p in folder.glob("*.json.gz")
              if folder.name not in ("unseen", "agent")]
    return sorted(set(p for p in found if not p.name.startswith("cpu_")))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


def gloo_rank_file(folder: Path, source: Path, rank: int, tag: str) -> Path:
    """SOURCE as rank RANK of a gloo job, named as a plain torch.profiler capture names it (no world size), with
    content of its own (TAG)."""
    data = json.loads(gzip.decompress(source.read_bytes()))
    data["distributedInfo"], data["trace_id"] = {"backend": "gloo", "rank": rank}, f"{tag}-{rank}"
    path = folder / f"{tag}_rank{rank}.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    return path
