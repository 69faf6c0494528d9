"""The planner's closing line when nothing makes a step fit on one GPU (course_lib.planner.search.elsewhere, lesson 1)."""

from course_lib.planner import plan
from course_lib.planner.config.gpus import GPUS


def test_seventy_b_qlora_on_a_t4_ends_with_where_it_would_fit():
    result = plan("llama-2-70b", gpu="t4", quant="nf4-dq", lora_rank=16, prepare_kbit=True)
    assert not result.tricks[-1].fits_after
    first = result.closing.splitlines()[0]
    assert first.startswith("nothing on one T4 fits; the smallest GPU that fits is ")
    named = next(g for g in GPUS.values() if f"fits is {g.name} (" in first)
    final = plan("llama-2-70b", result.tricks[-1].setup, gpu=named.name, suggest=False)
    assert final.fits and named.memory_bytes > GPUS["t4"].memory_bytes
    many = int(first.split(", or ")[1].split(" T4s")[0])
    zero3 = dict(quant="nf4-dq", lora_rank=16, checkpointing="every-layer", shard="zero3", gpu="t4", suggest=False)
    assert plan("llama-2-70b", gpus=many, **zero3).fits  # the 4-bit base sharded, as the line says
    assert not plan("llama-2-70b", gpus=many // 2, **zero3).fits
    assert "4-bit base sharded" in result.closing
    assert str(result).splitlines().index(result.closing.splitlines()[0]) > len(result.tricks)
    assert result.to_dict()["closing"] == result.closing


def test_a_plan_that_fits_has_no_closing_line():
    assert plan("llama-3.2-1b", gpu="t4", quant="nf4-dq", lora_rank=16).closing == ""
