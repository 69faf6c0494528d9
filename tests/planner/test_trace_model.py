"""The model the planner traces (course_lib.planner.trace.model): peft's adapters built without importing
bitsandbytes, which a meta trace never runs, and peft's answers about bitsandbytes left true after."""

import subprocess
import sys

import pytest

pytest.importorskip("bitsandbytes")  # what is left unimported must be installed for the test to mean anything


def test_a_lora_trace_leaves_bitsandbytes_unimported_and_peft_still_sees_it():
    code = (
        "import sys\n"
        "from course_lib.models import model_spec\n"
        "from course_lib.planner.config.setup import Setup\n"
        "from course_lib.planner.trace.compose import shallow_spec\n"
        "from course_lib.planner.trace.model import build_traced_model\n"
        "spec = shallow_spec(model_spec('llama-3.1-8b'), 3)\n"
        "model = build_traced_model(spec, Setup(lora_rank=8, precision='fp16'))\n"
        "adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)\n"
        "imported = 'bitsandbytes' in sys.modules\n"
        "from peft.import_utils import is_bnb_4bit_available, is_bnb_available\n"
        "print(adapters > 0, imported, is_bnb_available(), is_bnb_4bit_available())\n"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["True", "False", "True", "True"]
