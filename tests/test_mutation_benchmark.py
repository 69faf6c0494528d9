"""benchmarks/mutation_score.py's mutants still apply (each original text is in its file exactly once, and
its test targets exist) and cover every package of course_lib; the benchmark itself is not run here."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("mutation_score", ROOT / "benchmarks" / "mutation_score.py")
mutation_score = importlib.util.module_from_spec(SPEC)
sys.modules["mutation_score"] = mutation_score  # its dataclass looks itself up there
SPEC.loader.exec_module(mutation_score)


def test_every_mutant_applies_once_and_names_test_targets_that_exist():
    for mutant in mutation_score.MUTANTS:
        assert (ROOT / mutant.file).read_text().count(mutant.original) == 1, mutant.id
        assert mutant.original != mutant.replacement and mutant.tests, mutant.id
        for target in mutant.tests:
            assert (ROOT / target.split("::")[0]).is_file(), (mutant.id, target)


def test_the_mutants_cover_every_package_of_course_lib_and_have_unique_ids():
    ids = [mutant.id for mutant in mutation_score.MUTANTS]
    packages = {p.name for p in (ROOT / "course_lib").iterdir() if (p / "__init__.py").is_file()}
    covered = {Path(mutant.file).parts[1] for mutant in mutation_score.MUTANTS}
    assert len(ids) == len(set(ids))
    assert packages <= covered, packages - covered


def test_every_mutant_said_to_be_equivalent_is_one_of_the_mutants():
    assert set(mutation_score.EQUIVALENT) <= {mutant.id for mutant in mutation_score.MUTANTS}
