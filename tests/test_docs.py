"""The docs cannot rot: the walkthrough's commands print every line it shows, and docs/api.md lists every option."""

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from nanoengine.config import EngineConfig

ROOT = Path(__file__).parents[1]
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
API_REFERENCE = ROOT / "docs" / "api.md"


def commands_and_shown_output(text: str) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of the console blocks, with the lines shown after it (up to the next command);
    a ``...`` line marks output left out."""
    runs = []
    for indent, block in re.findall(r"^( *)```console\n(.*?)^\1```", text, re.S | re.M):
        for line in block.splitlines():
            line = line.removeprefix(indent)  # a block nested in a list item is indented as a whole
            if line.startswith("$ "):
                runs.append((line[2:], []))
            elif line.strip() not in ("", "..."):
                runs[-1][1].append(line)
    return runs


def is_in_order(shown: list[str], printed: list[str]) -> bool:
    remaining = iter(printed)
    return all(any(line == out for out in remaining) for line in shown)


def test_every_walkthrough_command_prints_what_the_walkthrough_shows(smollm2_dir):
    runs = commands_and_shown_output(WALKTHROUGH.read_text())
    assert [command for command, _ in runs] == ["python docs/walkthrough.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for command, shown in runs:
        run = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        printed = run.stdout.splitlines()
        missing = next((line for i, line in enumerate(shown) if not is_in_order(shown[:i + 1], printed)), None)
        assert missing is None, f"the walkthrough shows a line that {command!r} no longer prints:\n{missing}"


def test_the_api_reference_options_table_lists_every_engine_option():
    options = {f.name for f in fields(EngineConfig) if f.init} - {"model"}
    listed = set(re.findall(r"^\| `(\w+)` \|", API_REFERENCE.read_text(), re.M))
    assert options <= listed, f"missing from docs/api.md's options table: {sorted(options - listed)}"
