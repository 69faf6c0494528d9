"""benchmarks/mutation_score.py's mutants still apply (a listed one's original text is in its file exactly
once and its test targets exist; a generated one leaves valid Python), its rules write the mutants they
name, and its sample covers every package of course_lib; the benchmark itself is not run here."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("mutation_score", ROOT / "benchmarks" / "mutation_score.py")
mutation_score = importlib.util.module_from_spec(SPEC)
sys.modules["mutation_score"] = mutation_score  # its dataclass looks itself up there
SPEC.loader.exec_module(mutation_score)

GENERATED = mutation_score.generate()


def test_every_listed_mutant_applies_once_and_names_test_targets_that_exist():
    for mutant in mutation_score.LISTED:
        assert (ROOT / mutant.file).read_text().count(mutant.original) == 1, mutant.id
        assert mutant.original != mutant.replacement and mutant.tests, mutant.id
        for target in mutant.tests:
            assert (ROOT / target.split("::")[0]).is_file(), (mutant.id, target)


def test_every_generated_mutant_applies_to_its_file_and_leaves_python():
    assert mutation_score.check_applies(GENERATED, ROOT) == ""
    for mutant in GENERATED:
        text = (ROOT / mutant.file).read_text()
        assert mutant.apply(text) != text, mutant.id
        assert text.encode()[mutant.offset :].decode().startswith(mutant.original), mutant.id


def test_the_rules_write_the_mutants_they_name(tmp_path):
    (tmp_path / "course_lib").mkdir()
    example = """
def f(a, b):
    if a < b:
        return a + 1
    return (a.float()
            + b + 2)
def g(p, q):
    return p.double() - q.double().to(p.device), q.to("cpu", torch.float32)
"""
    (tmp_path / "course_lib" / "example.py").write_text(example.lstrip())
    made = {
        (mu.rule, mu.original, mu.replacement, mu.line) for mu in mutation_score.generate(tmp_path, everything=True)
    }
    assert made == {
        ("relational", "a < b", "(a <= b)", 2),
        ("negate", "a < b", "(not (a < b))", 2),
        ("off_by_one", "a + 1", "(a)", 3),
        ("sum_term", "a + 1", "(1)", 3),
        ("sum_term", "a + 1", "(a)", 3),
        ("upcast", "a.float()", "(a)", 4),  # the line coverage counts: the statement's first
        ("sum_term", "a.float()\n            + b + 2", "(b + 2)", 4),
        ("sum_term", "a.float()\n            + b + 2", "(a.float() + 2)", 4),
        ("sum_term", "a.float()\n            + b + 2", "(a.float() + b)", 4),
        # both upcasts of a difference at once (one alone changes nothing: type promotion); the device kept
        ("upcast", "p.double() - q.double().to(p.device)", "(p - q.to(p.device))", 7),
        ("upcast", 'q.to("cpu", torch.float32)', "(q.to('cpu'))", 7),
    }


def test_the_sample_is_large_enough_covers_every_package_and_has_unique_ids():
    mutants = [*GENERATED, *mutation_score.LISTED]
    ids = [mutant.id for mutant in mutants]
    packages = {p.name for p in (ROOT / "course_lib").iterdir() if (p / "__init__.py").is_file()}
    assert len(ids) == len(set(ids))
    assert len(GENERATED) >= mutation_score.LEAST
    for source in (GENERATED, mutation_score.LISTED):
        covered = {Path(mutant.file).parts[1] for mutant in source}
        assert packages <= covered, packages - covered
    assert {mutant.rule for mutant in GENERATED} == set(mutation_score.RULES) - {"listed"}


def test_every_mutant_said_to_be_equivalent_is_one_of_the_mutants():
    assert set(mutation_score.EQUIVALENT) <= {mutant.id for mutant in [*GENERATED, *mutation_score.LISTED]}
