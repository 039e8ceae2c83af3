"""The docs cannot rot: the walkthrough's commands print every line it shows, docs/api.md lists every option, and
every relative link in the README, docs/ and examples/ leads to a file and heading that exist."""

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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]


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


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to hyphens (-1, -2 on repeats)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # a "#" inside a code block is no heading
    anchors = set()
    for heading in re.findall(r"^#+ +(.+?) *$", text, re.M):
        anchor = base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        repeat = 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{base}-{repeat}"
        anchors.add(anchor)
    return anchors


def relative_links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans hold no links
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", target)]


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in relative_links(page.read_text()):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_that_tells_of_a_dead_core_says_what_supervision_does():
    """serving.md and design.md once said a dead core is never restarted, long after operations.md described
    its restarts: each page that tells of a dead core must name --max-core-restarts and never deny a restart."""
    denials = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"\s+", " ", page.read_text())
        if not re.search(r"\bdead (local |remote )?(engine )?core", text):
            continue
        if "--max-core-restarts" not in text:
            denials.append(f"{page.name}: tells of a dead core, but not of --max-core-restarts")
        for sentence in re.split(r"(?<=[.;:])\s", text):
            denies = re.search(r"\b(not|never)\b[^.;:]*\brestart", sentence) and "core" in sentence
            if denies and "--max-core-restarts 0" not in sentence:
                denials.append(f"{page.name}: {sentence.strip()}")
    assert not denials, "\n".join(denials)
