"""The shape of a lesson as a learner reads it (issue 47, "the lessons as a learner reads them").

- Each lesson opens with a learner's problem: the markdown before its first section heading asks a question.
- Lesson 0 states the course's rule (the phase that holds the peak decides the trick), and every later
  lesson refers back to it by the same words.
- Each lesson ends with the section "## On your own fine-tune", with the link to its exercise in that
  section or in the one before it.
- A deep dive is marked as optional and says that the learner can skip to the summary; lesson 6
  (several processes) says in its opening that it is optional with one GPU.
- docs/glossary.md exists; every glossary link in notebooks/ is the absolute address
  `course_lib.course.GLOSSARY_URL` (a relative link breaks on Colab) and lands on one of its headings
  (GitHub's anchor rule); every glossary term is linked from at least one lesson.
"""

import re
from pathlib import Path

import nbformat
import pytest
from test_sources import github_anchor  # GitHub's anchor rule, as the references' links are checked

from course_lib.course import BRANCH, GLOSSARY_URL, REPOSITORY

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
GLOSSARY = ROOT / "docs" / "glossary.md"
LAST_SECTION = "## On your own fine-tune"
RULE = "the course's rule"  # the stable phrase: lesson 0 states it, lessons 1-7 refer back to it
DEEP_DIVE = "## Deep dive (optional): "
SECTION = re.compile(r"^##+ ", re.M)  # a section heading; the title is the only "# " heading
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def markdown(path: Path) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "markdown"]


def opening(path: Path) -> str:
    """The markdown before the first section heading (the title, the badge, the problem, the preview)."""
    text = []
    for source in markdown(path):
        heading = SECTION.search(source)
        if heading:
            text.append(source[: heading.start()])
            break
        text.append(source)
    return "\n".join(text)


def sections(path: Path) -> list[tuple[str, str]]:
    """(heading line, text up to the next section heading) of every `## ` section, in order."""
    text = "\n\n".join(markdown(path))
    starts = [m.start() for m in re.finditer(r"^## ", text, re.M)]
    return [(text[a:].splitlines()[0], text[a:b]) for a, b in zip(starts, starts[1:] + [len(text)])]


def prose(text: str) -> str:
    """Text without code, link targets and images: what a learner reads as sentences."""
    return LINK.sub("]", CODE.sub("", text))


def glossary_anchors() -> dict[str, str]:
    """GitHub anchor of each term heading (`## term`) of docs/glossary.md, with the term."""
    headings = re.findall(r"^## (.+)$", GLOSSARY.read_text(), flags=re.M)
    return {github_anchor(h): h for h in headings}


def glossary_links(path: Path) -> list[str]:
    return [target for source in markdown(path) for target in LINK.findall(source) if "glossary" in target]


def test_there_are_eight_lessons_and_a_glossary():
    assert len(LESSONS) == 8
    assert GLOSSARY.exists()
    assert len(glossary_anchors()) >= 20


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_each_lesson_opens_with_a_learners_question(path):
    text = prose(opening(path))
    assert re.search(r"\w[*_]*\?", text), (
        f"{path.name}: open with the learner's problem, asked as a question, before the first section heading"
    )


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_each_lesson_ends_with_on_your_own_fine_tune_and_its_exercise(path):
    found = sections(path)
    assert found and found[-1][0] == LAST_SECTION, f"{path.name}: the last section must be {LAST_SECTION!r}"
    body = found[-1][1]
    assert "```" in body or re.search(r"^ {4}\S", body, re.M) or "`course-lib plan " in body, (
        f"{path.name}: {LAST_SECTION!r} gives the command or the lines to run"
    )
    exercise = f"exercises/{path.name}"
    assert exercise in found[-1][1] or (len(found) > 1 and exercise in found[-2][1]), (
        f"{path.name}: link the exercise in the last section or the one right before it"
    )


def test_lesson_0_states_the_rule_plainly():
    paragraphs = [p for source in markdown(LESSONS[0]) for p in re.split(r"\n\s*\n", source)]
    stated = [p for p in paragraphs if p.startswith("**The course's rule.**")]
    assert stated, "lesson 0 states the rule in a paragraph of its own, starting **The course's rule.**"
    rule = " ".join(prose(stated[0]).split())
    for part in ("phase", "holds the peak", "weights", "gradients", "optimizer state", "activations", "measure again"):
        assert part in rule, f"lesson 0's rule must name {part!r}: {rule!r}"
    assert stated[0] in opening(LESSONS[0]), "lesson 0 states the rule in its opening"


@pytest.mark.parametrize("path", LESSONS[1:], ids=lambda p: p.name)
def test_later_lessons_refer_back_to_the_rule(path):
    text = " ".join(" ".join(markdown(path)).split()).lower()
    assert RULE in text, f"{path.name}: refer back to {RULE!r} (lesson 0) where the lesson's trick applies"
    assert "lesson 0" in text


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_a_deep_dive_is_marked_optional_with_the_way_out(path):
    for source in markdown(path):
        if DEEP_DIVE in source:
            assert re.search(r"skip to the summary", source, re.I), (
                f"{path.name}: say the learner can skip to the summary"
            )


def test_lesson_3_marks_its_deep_dive_and_lesson_6_is_optional_with_one_gpu():
    lesson = {p.name[:2]: p for p in LESSONS}
    assert any(s.startswith(DEEP_DIVE) for s in markdown(lesson["03"]))
    assert re.search(r"optional with one GPU", opening(lesson["06"]), re.I)


def test_glossary_url_is_the_repositorys():
    assert GLOSSARY_URL == f"https://github.com/{REPOSITORY}/blob/{BRANCH}/docs/glossary.md"


def test_glossary_entries_are_short():
    blocks = re.split(r"^## .+$", GLOSSARY.read_text(), flags=re.M)[1:]
    assert blocks
    for block in blocks:
        assert 15 <= len(block.split()) <= 110, f"a glossary entry is 2 to 4 short sentences: {block[:80]!r}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_glossary_link_is_absolute_and_lands_on_a_term(path):
    anchors = glossary_anchors()
    for target in glossary_links(path):
        address, _, anchor = target.partition("#")
        assert address == GLOSSARY_URL, f"{path.name}: link the glossary by GLOSSARY_URL (Colab), not {address!r}"
        assert anchor in anchors, f"{path.name}: #{anchor} is no heading of docs/glossary.md"


def test_every_glossary_term_is_linked_from_a_lesson():
    linked = {target.partition("#")[2] for path in LESSONS for target in glossary_links(path)}
    missing = sorted(set(glossary_anchors()) - linked)
    assert not missing, f"glossary terms no lesson links: {missing}"


def test_the_anchor_rule_and_the_checks_catch_a_bad_link():
    assert github_anchor("sbh and 5as/h") == "sbh-and-5ash"
    assert github_anchor("Allocated vs reserved") == "allocated-vs-reserved"
    assert prose("What is `x?` [here](https://a.b/c?d=1)") == "What is  [here]"
    assert not re.search(r"\w[*_]*\?", prose("What is `x?` [here](https://a.b/c?d=1)"))
