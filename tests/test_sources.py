"""What a learner reads is sourced and clean.

- No notebook (lessons, solutions, exercises) and no `course_lib` file names the internal fact sheet
  FACTS.md: citations point to docs/references.md, whose headings are the sources.
- Every `references.md#anchor` link in the notebooks, `course_lib`, docs/ and README names a heading of
  docs/references.md (GitHub's anchor rules), and an explicit `<a id="anchor"></a>` on the line before
  that heading: JupyterLab gives headings other ids than GitHub, and lands such a link on that tag.
- Every row of docs/myths.md has a verdict, a labelled number and the notebook section that prints it.
- Committed notebooks carry no stderr stream, no path of the machine that ran them and no unfinished
  progress bar in their outputs.
"""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = ROOT / "docs" / "references.md"
NOTEBOOKS = sorted(
    p.relative_to(ROOT) for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb")
)
PACKAGE = sorted(
    p.relative_to(ROOT)
    for p in (ROOT / "course_lib").rglob("*")
    if p.is_file() and p.suffix in (".py", ".json", ".md", ".txt")
)
DOCS = sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))
README = Path("README.md")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def reference_anchors() -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", REFERENCES.read_text(), flags=re.MULTILINE)
    return {github_anchor(h) for h in headings}


def test_github_anchor_follows_githubs_rules():
    assert (
        github_anchor("Korthikanti et al. 2022, Reducing Activation Recomputation")
        == "korthikanti-et-al-2022-reducing-activation-recomputation"
    )
    assert github_anchor("torch 2.13.0 torch/optim/adamw.py, `zero_grad`") == "torch-2130-torchoptimadamwpy-zero_grad"


def test_references_exist_with_one_source_per_heading():
    text = REFERENCES.read_text()
    sources = re.findall(r"^### (.+)$", text, flags=re.MULTILINE)
    assert len(sources) >= 20
    anchors = [github_anchor(s) for s in sources]
    assert len(anchors) == len(set(anchors)), "two sources share an anchor"
    for block in re.split(r"^### .+$", text, flags=re.MULTILINE)[1:]:
        assert len(block.split()) >= 15, "each source says what it is and which facts the course takes from it"


@pytest.mark.parametrize("path", NOTEBOOKS + PACKAGE, ids=str)
def test_no_learner_facing_file_names_the_internal_fact_sheet(path):
    text = (ROOT / path).read_text()
    lines = [line.strip()[:120] for line in text.splitlines() if "FACTS.md" in line]
    assert not lines, f"{path} cites FACTS.md (internal): cite the source in docs/references.md instead: {lines}"


def _link_targets(path: Path) -> list[str]:
    return re.findall(r"references\.md#([\w\-]+)", (ROOT / path).read_text())


@pytest.mark.parametrize("path", NOTEBOOKS + PACKAGE + DOCS + [README], ids=str)
def test_every_reference_link_names_a_heading(path):
    anchors = reference_anchors()
    missing = sorted({a for a in _link_targets(path) if a not in anchors})
    assert not missing, f"{path} links to docs/references.md anchors that no heading has: {missing}"


def test_links_inside_references_resolve():
    anchors = reference_anchors()
    inner = re.findall(r"\]\(#([\w\-]+)\)", REFERENCES.read_text())
    assert inner and not sorted(set(inner) - anchors)
    assert not sorted(set(inner) - set(explicit_ids())), "give each heading linked to an explicit <a id>"


def explicit_ids(text: str | None = None) -> dict[str, str | None]:
    """Each `<a id="..."></a>` line of references.md, with the GitHub anchor of the heading on the next
    line (None when the next line is no heading)."""
    lines = (REFERENCES.read_text() if text is None else text).splitlines()
    ids = {}
    for line, following in zip(lines, lines[1:] + [""]):
        tag = re.fullmatch(r'<a id="([\w\-]+)"></a>', line.strip())
        if tag:
            heading = re.match(r"^#{1,6} (.+)$", following)
            ids[tag.group(1)] = github_anchor(heading.group(1)) if heading else None
    return ids


def test_explicit_ids_are_read_with_the_heading_that_follows():
    text = '<a id="a-b"></a>\n### A, b\n\n<a id="c"></a>\nplain text\n'
    assert explicit_ids(text) == {"a-b": "a-b", "c": None}


def test_each_explicit_id_is_the_github_anchor_of_the_heading_after_it():
    wrong = {tag: heading for tag, heading in explicit_ids().items() if tag != heading}
    assert explicit_ids() and not wrong, f"<a id> not followed by its own heading: {wrong}"


@pytest.mark.parametrize("path", NOTEBOOKS + PACKAGE + DOCS + [README], ids=str)
def test_every_reference_link_has_an_explicit_id_for_jupyterlab(path):
    ids = explicit_ids()
    missing = sorted({a for a in _link_targets(path) if a not in ids})
    assert not missing, (
        f'{path} links to docs/references.md anchors without an explicit <a id="..."></a> '
        f"on the line before their heading (JupyterLab lands such links at the top): {missing}"
    )


MYTHS = ROOT / "docs" / "myths.md"


def myths_rows() -> list[str]:
    return [
        line
        for line in MYTHS.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| claim") and not line.startswith("|---")
    ]


def notebook_headings(path: Path) -> set[str]:
    cells = nbformat.read(path, as_version=4).cells
    return {
        line.lstrip("#").strip()
        for cell in cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("#")
    }


def test_every_myth_has_a_verdict_a_number_and_the_cell_that_prints_it():
    rows = myths_rows()
    assert len(rows) >= 15
    for row in rows:
        claim, verdict, number, where = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert claim and len(verdict.split()) >= 5, row
        assert re.search(r"\d", number) or "your GPU" in number, f"no number: {row}"
        assert re.match(r"(measured|predicted|simulated)", number), f"label the number (measured/predicted): {row}"
        links = re.findall(r"\]\(\.\./(notebooks/[\w.]+\.ipynb)\)", where)
        sections = re.findall(r'"(\d+\. [^"]+)"', where)
        assert links and sections, f"name the notebook and the section heading: {row}"
        for link in links:
            headings = notebook_headings(ROOT / link)
            missing = [s for s in sections if s not in headings]
            assert not missing, f"{link} has no section {missing}"


MACHINE_PATH = re.compile(r"(/work/|/root/|/tmp/|/home/\w+/|/Users/\w+/|[A-Z]:\\Users\\)")
PROGRESS = re.compile(r"(\d+)/(\d+) \[")


def _output_texts(output) -> list[str]:
    texts = []
    if "text" in output:
        texts.append(output["text"])
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            texts.append(value if isinstance(value, str) else "".join(value))
    if output.get("output_type") == "error":
        texts.append("\n".join(output.get("traceback", [])))
    return texts


def committed_output_problems(path: Path) -> list[str]:
    """stderr streams, machine paths and unfinished progress bars in a notebook's saved outputs."""
    problems = []
    for number, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                problems.append(f"cell {number}: a stderr stream ({output['text'].strip()[:80]!r})")
            for text in _output_texts(output):
                match = MACHINE_PATH.search(text)
                if match:
                    problems.append(f"cell {number}: a machine path {text[match.start() : match.start() + 60]!r}")
                for done, total in PROGRESS.findall(text):
                    if done != total:
                        problems.append(f"cell {number}: a progress bar stuck at {done}/{total}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=str)
def test_committed_outputs_are_clean(path):
    problems = committed_output_problems(ROOT / path)
    assert not problems, f"{path}: " + "; ".join(problems)


def test_the_output_check_catches_what_it_looks_for(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="warning"),
        nbformat.v4.new_output("stream", name="stdout", text="see /root/x.py"),
        nbformat.v4.new_output("display_data", data={"text/plain": "steps:   0%|    | 0/3 [00:00<?]"}),
    ]
    nb.cells = [cell]
    nbformat.write(nb, tmp_path / "bad.ipynb")
    problems = committed_output_problems(tmp_path / "bad.ipynb")
    assert len(problems) == 3, problems


# --- docs/myths.md: every measured number is in the output of the cells its row names ----------

_NUMBER = re.compile(
    r"(?<![\w.,])(?:\d+\.\d+e[-+]?\d+|\d+e[-+]\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+"
    r"|\d+(?= (?:MiB|GiB|KiB|MB|GB|ms)\b))(?![\w.]*\d)"
)  # decimals, grouped, or with a unit
_ANY_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _myths_rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "myths.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and "../notebooks/" in cells[3]:
            rows.append(cells)
    return rows


def _section_outputs(notebook: Path, heading: str) -> str:
    """The text outputs of the code cells under a heading (its subsections included)."""
    text, level = [], None
    for cell in nbformat.read(notebook, 4).cells:
        if cell.cell_type == "markdown":
            for hashes, title in re.findall(r"^(#+) (.*)$", cell.source, re.M):
                if title.strip() == heading:
                    level = len(hashes)
                elif level is not None and len(hashes) <= level:
                    level = None
        elif level is not None:
            for output in cell.get("outputs", []):
                value = output.get("text") or output.get("data", {}).get("text/plain", "")
                text.append(value if isinstance(value, str) else "".join(value))
    return "\n".join(text)


def _printed(quoted: str, output: str) -> bool:
    """The quoted number is printed, or is a printed number rounded to the digits it shows (1.7e-07 for
    1.74e-07, 0.79 for 7.9e-01)."""
    if quoted in output:
        return True
    value = float(quoted.replace(",", ""))
    mantissa = quoted.split("e")[0].replace(",", "")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(quoted.split("e")[1]) if "e" in quoted else 0
    step = 10.0 ** (exponent - decimals)
    return any(
        abs(float(found.replace(",", "")) - value) <= step / 2 * (1 + 1e-9)
        for found in _ANY_NUMBER.findall(output)
        if found.strip("+-,")
    )


@pytest.mark.parametrize("row", _myths_rows(), ids=lambda row: row[0][:50])
def test_every_myths_number_is_printed_by_the_cells_it_names(row):
    claim, verdict, number, where = row
    notebook = ROOT / re.search(r"\(\.\./(notebooks/[^)]+)\)", where).group(1)
    headings = re.findall(r'"([^"]+)"', where)
    output = "\n".join(_section_outputs(notebook, heading) for heading in headings)
    assert output, f"myths.md names sections of {notebook.name} with no output: {headings}"
    measured = re.sub(r"\d+\.\d+\.\d+", "", re.sub(r"`[^`]*`", "", number))  # versions and code are no measurements
    missing = [quoted for quoted in _NUMBER.findall(measured) if not _printed(quoted, output)]
    assert not missing, f"{notebook.name}, {headings}: {missing} not in the output of those sections"
