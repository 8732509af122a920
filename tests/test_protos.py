"""Generated protobuf code is checked in and never edited by hand: regenerate
every proto into a temp dir and fail on any difference (so CI fails on stale
generated code), and require a comment on every field and rpc."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))

# A field (scalar, message, repeated, optional, map) or an rpc line.
_DECLARATION = re.compile(r"^\s*(rpc\s+\w+|(repeated\s+|optional\s+)?[\w.]+(<[^>]*>)?\s+\w+\s*=\s*\d+)")


def test_generated_code_matches_the_protos(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", "scripts/gen_protos.sh", str(tmp_path)], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "gen_protos.sh generated nothing"
    stale = [str(rel) for rel in fresh
             if not (ROOT / rel).is_file() or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, (f"generated code is stale or missing: {stale}; run "
                       "`bash scripts/gen_protos.sh` and commit the result (never edit it by hand)")


def test_every_field_and_rpc_has_a_comment():
    assert PROTOS
    missing = []
    for path in PROTOS:
        previous = ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _DECLARATION.match(line) and not previous.startswith("//"):
                missing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
            if line.strip():
                previous = line.strip()
    assert not missing, "declarations without a comment line above:\n" + "\n".join(missing)
