"""The device scripts run only on the lent GPU machine, where a syntax error
costs a call of the session's 30 minutes: each must at least parse."""
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").rglob("*.sh"))  # sessions/ too


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name + "/" + p.name)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
