import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dbfixtures import _isolated_home, blobs, engine, postgres_url  # noqa: E402,F401  (pytest fixtures)
