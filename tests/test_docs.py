"""The docs pages stay true: the recipe's file:line references hold what their rows name, and every relative link
of README.md and docs/*.md reaches a file (and a heading of it)."""

import ast
import re
import unicodedata
from pathlib import Path

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The equations of a training step the recipe must show: the learning rate, the forced and the on-use weight
# normalization, the noise draw, the preconditioning, the loss weight, the loss and the power-function EMA.
STEP_EQUATIONS = {"67", "66", "16", "4", "5", "6", "7", "8", "47", "15", "21", "126", "127", "119"}


def recipe_rows() -> list[tuple[str, str, Path, int, str]]:
    """(equation, what, file, line, what the line holds) of every row of docs/recipe.md's table."""
    rows = []
    for line in (REPO / "docs" / "recipe.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        reference = re.fullmatch(r"`([\w/.]+\.py):(\d+)`", cells[3]) if len(cells) == 5 else None
        if reference:
            rows.append((cells[0], cells[1], REPO / reference[1], int(reference[2]), cells[4].strip("`")))
    return rows


def text_from(path: Path, line: int) -> str:
    """The line of path, or the whole def or class when one starts on it (decorators not included)."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.lineno == line:
            return "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])
    return source.splitlines()[line - 1]


def test_the_recipes_lines_hold_what_its_rows_name():
    rows = recipe_rows()
    wrong = []
    for equation, what, path, line, holds in rows:
        assert len(holds) >= 8, f"row {what!r} names too little to check: {holds!r}"
        lines = path.read_text().splitlines() if path.is_file() else []
        if not 1 <= line <= len(lines) or holds not in text_from(path, line):
            wrong.append(f"{path.relative_to(REPO)}:{line} ({what}) does not hold {holds!r}")
    assert not wrong, "; ".join(wrong)
    assert STEP_EQUATIONS <= {equation for equation, *_ in rows}
    adam = " ".join(holds for _, what, _, _, holds in rows if what.startswith("Adam"))
    assert "ADAM_BETAS" in adam and "ADAM_EPS" in adam


def test_a_stale_recipe_reference_is_caught(tmp_path):
    # The check itself: a row whose line moved (one line off) no longer holds its expression.
    equation, what, path, line, holds = next(row for row in recipe_rows() if row[0] == "15")
    moved = tmp_path / path.name
    moved.write_text("\n" + path.read_text())
    assert holds in text_from(path, line) and holds not in text_from(moved, line)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", without_code_blocks(text), flags=re.M):
        slug = "".join(c for c in heading.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
        slug = slug.replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def without_code_blocks(text: str) -> str:
    """text with its fenced code blocks removed (their lines are code, not Markdown)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken, links = [], 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto: and the like are not files of this repository
            links += 1
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.is_file():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert links and not broken, broken


def test_the_readme_links_every_docs_page():
    # One page per topic beside the README; its index links each of them, and no page is left unlinked.
    readme = (REPO / "README.md").read_text()
    linked = {target.partition("#")[0] for target in re.findall(r"\]\((docs/[^)\s]+)\)", readme)}
    topics = {f"docs/{name}.md" for name in ("recipe", "data", "training", "dynamics", "evaluation", "speed",
                                              "extending", "formats", "api", "reliability")}
    assert topics <= {f"docs/{page.name}" for page in PAGES[1:]} <= linked


def test_the_readme_orients_and_every_other_topic_has_its_page():
    # The README holds what EDM2 is, how to start, the ImageNet workflow, the two methods built on it (few-step
    # generation, text-to-image: their commands, results and pitfalls), the docs index and the two maps (the code's
    # layout and the paper's equations in the code), in that order; every other topic is a heading of a docs page.
    readme = (REPO / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections == ["Quickstart", "Install", "The full ImageNet-512 workflow", "Few-step generation",
                        "Text-to-image", "Documentation", "Layout", "The paper in the code"]
    opening = readme[:readme.index("## Quickstart")]
    assert "EDM2" in opening.split("\n\n")[1] and "docs/recipe.md" in opening
