"""The README works as written: its set-up commands are the ones CI runs, every Python block runs, every link
points inside the repository."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# A block preceded (on the line before its fence) by this comment is shown but not run: only for code that needs
# the Hub (a download or an upload), which tests cannot reach.
NOT_RUN_MARKER = re.compile(r"<!--\s*not-run:\s*(?P<reason>[^>]*?)\s*-->")
MAX_NOT_RUN_BLOCKS = 2
HUB_ONLY_LINE = re.compile(r"^\s*(from \S+ import .+|import \S+.*|#.*|.*\"<user>/<repo>\".*)?$")


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", README.read_text())


def test_ci_runs_the_readme_test_command_exactly():
    main_job, test_command = _readme_commands()[:2]
    assert "pytest" in test_command and "training.tinyshakespeare" in main_job
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_command]


def python_blocks(text: str) -> list[dict]:
    """Every ```python block of ``text``, in order: its code, the heading it sits under, and whether it is marked
    not-run (the marker must sit on the line right before the fence)."""
    blocks, heading, previous = [], "top", ""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```") and line.strip() != "```python":  # another language: skip to its closing fence
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                index += 1
            index, previous = index + 1, ""
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            end = index + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"unterminated ```python block at README line {index + 1}")
            marker = NOT_RUN_MARKER.search(previous)
            blocks.append({
                "code": "\n".join(lines[index + 1 : end]) + "\n",
                "heading": heading,
                "line": index + 1,
                "not_run": marker.group("reason") if marker else None,
            })
            index, previous = end + 1, ""
            continue
        if line.strip():
            previous = line
        index += 1
    return blocks


README_BLOCKS = python_blocks(README.read_text())
RUN_BLOCKS = [block for block in README_BLOCKS if block["not_run"] is None]


def test_python_block_parser_sees_markers_and_headings():
    text = "# A\n```python\nx = 1\n```\n```bash\n# not a heading\n```\n## B\n<!-- not-run: hub -->\n```python\ny = 2\n```\n"
    blocks = python_blocks(text)
    assert [(b["heading"], b["code"], b["not_run"]) for b in blocks] == [("A", "x = 1\n", None), ("B", "y = 2\n", "hub")]
    with pytest.raises(ValueError, match="unterminated"):
        python_blocks("```python\nx = 1\n")


def test_readme_has_the_four_quickstarts_and_runs_nearly_every_block():
    headings = " | ".join(block["heading"] for block in RUN_BLOCKS)
    for topic in ("EGA-GPT", "LoRA", "GPT-2", "CHIAR-Former"):
        assert topic in headings, f"no runnable Python block under a heading about {topic}: {headings}"
    skipped = [block for block in README_BLOCKS if block["not_run"] is not None]
    assert len(skipped) <= MAX_NOT_RUN_BLOCKS, f"{len(skipped)} README blocks are marked not-run"
    for block in skipped:
        assert "hub" in block["not_run"].lower(), f"README line {block['line']}: not-run is only for Hub access"
        for line in block["code"].splitlines():
            assert HUB_ONLY_LINE.match(line), f"README line {block['line']}: {line!r} is not a Hub-only line; run it"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[f"line{b['line']}-{b['heading']}" for b in RUN_BLOCKS])
def test_readme_python_block_runs_as_written(block, tmp_path):
    """Each block alone, in a fresh interpreter (so it must define everything it uses), offline, in an empty
    folder (what it saves lands there)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    script = tmp_path / "block.py"
    script.write_text(block["code"])
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (
        f"README block at line {block['line']} ({block['heading']}) failed:\n{block['code']}\n"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("document", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_point_inside_the_repository(document):
    path = ROOT / document
    for target in LINK.findall(path.read_text()):
        assert "://" not in target and not target.startswith("//"), f"{document} links outside the repository: {target}"
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{document} links to a missing path: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked.read_text()), f"{document} links to a missing heading: {target}"


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lower case, punctuation dropped, spaces to hyphens)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_readme_is_written_for_users():
    text = README.read_text()
    lines = text.count("\n")
    assert 120 <= lines <= 230, f"the README has {lines} lines; details belong under docs/"
    for internal in (r"\bstop \d", r"\bthis stop\b", r"\bissue \d", r"\.\./shared/docs"):
        assert not re.search(internal, text, re.IGNORECASE), f"internal wording in the README: {internal}"
