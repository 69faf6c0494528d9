"""Tests of course_lib.qlora (lesson 5): the recipe, the model it builds, the Trainer run, and the
planner against measurement on the CPU."""

from __future__ import annotations

import importlib
from dataclasses import asdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import qlora
from course_lib.checkpointing import assert_gradients_flow
from course_lib.device import DtypePolicy
from course_lib.planner import get_gpu

ABLATION = importlib.import_module("course_lib.qlora.ablation")  # the module: the package's `ablation` is its function
T4 = DtypePolicy(torch.float32, torch.float16, True, "T4")
A100 = DtypePolicy(torch.float32, torch.bfloat16, False, "A100")
CPU = DtypePolicy(torch.float32, None, False, "CPU")


@pytest.fixture(scope="module")
def config():
    return qlora.tiny_llama_config(hidden=256, layers=1, intermediate=512, vocab=512)


# ---------------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(lora_rank=0), "lora_rank > 0"),
        (dict(optim="adamw"), "unknown optim"),
        (dict(batch=0), "batch must be a positive integer"),
        (dict(accum=True), "accum must be (a positive integer|an int)"),
        (dict(lora_rank=-1, nf4=False), "lora_rank must be"),
    ],
)
def test_bad_recipes_fail_with_one_line(fields, message):
    with pytest.raises(qlora.RecipeError, match=message) as error:
        qlora.Recipe(**fields).validate()
    assert "\n" not in str(error.value)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 8), accum=st.integers(1, 16), trick=st.sampled_from(qlora.TRICKS))
def test_switching_a_trick_off_keeps_the_effective_batch_and_a_valid_recipe(batch, accum, trick):
    recipe = qlora.Recipe(batch=batch, accum=accum)
    off = recipe.without(trick).validate()
    assert off.effective_batch == recipe.effective_batch
    assert off != recipe or (trick == "accumulation" and accum == 1)
    assert recipe.all_off().validate().effective_batch == recipe.effective_batch
    if trick == "accumulation":
        assert off.accum == 1


def test_unknown_trick_is_named():
    with pytest.raises(qlora.RecipeError, match="unknown trick 'flash'"):
        qlora.Recipe().without("flash")


def test_planner_setup_follows_the_precision_policy():
    recipe = qlora.Recipe()
    t4 = qlora.planner_setup(recipe, T4)
    assert (t4.precision, t4.quant, t4.optimizer) == ("fp16", "nf4-dq", "paged_adamw8bit")
    assert t4.checkpointing == "every-layer" and t4.prepare_kbit
    assert qlora.planner_setup(recipe, A100).precision == "bf16"
    assert qlora.planner_setup(recipe, CPU).precision == "fp32"
    full = qlora.planner_setup(recipe.all_off(), T4)  # fp32 trainable weights, autocast for activations
    assert (full.precision, full.lora_rank, full.quant, full.batch, full.accum) == ("fp32", 0, "none", 4, 1)


def test_training_arguments_carry_every_trick_and_the_t4_precision(tmp_path):
    args = qlora.training_arguments(qlora.Recipe(batch=1, accum=16), tmp_path, max_steps=3, policy=T4)
    assert args.per_device_train_batch_size == 1 and args.gradient_accumulation_steps == 16
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert "use_reentrant" in str(args.to_dict())
    assert args.optim.value == "paged_adamw_8bit"
    assert args.fp16 and not args.bf16  # bf16 breaks on a T4: fp16 autocast + GradScaler
    cpu = qlora.training_arguments(qlora.Recipe(), tmp_path, max_steps=3, policy=CPU)
    assert not cpu.fp16 and not cpu.bf16


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 20), seq=st.integers(2, 40), vocab=st.integers(2, 100), seed=st.integers(0, 5))
def test_counting_dataset_counts_modulo_vocab(n, seq, vocab, seed):
    rows = qlora.counting_dataset(n, seq, vocab, seed)
    assert len(rows) == n
    for row in rows:
        ids = row["input_ids"]
        assert ids.shape == (seq,) and torch.equal(row["labels"], ids)
        assert torch.equal((ids[1:] - ids[:-1]) % vocab, torch.ones(seq - 1, dtype=ids.dtype))


def test_counting_dataset_rejects_bad_sizes():
    with pytest.raises(ValueError, match="seq must be a (positive integer|whole number >= 1)"):
        qlora.counting_dataset(4, 0, 10)


# ---------------------------------------------------------------------------------------------------
# The model, measured and predicted
# ---------------------------------------------------------------------------------------------------


def test_qlora_model_is_nf4_double_quantized_with_fp32_adapters_and_gradients_flow(config):
    import bitsandbytes as bnb

    model = qlora.build_model(config, qlora.Recipe(), "cpu")
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7  # q, k, v, o, gate, up, down of one layer; the output layer stays
    for module in quantized:
        assert module.weight.quant_state.quant_type == "nf4" and module.weight.quant_state.nested
        assert not module.weight.requires_grad
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    ids = torch.randint(0, config.vocab_size, (1, 16))
    assert_gradients_flow(model, {"input_ids": ids, "labels": ids})


def test_real_weights_come_from_a_checkpoint_folder(config, tmp_path):
    """`weights=` loads a checkpoint (here a local folder; on Colab it may be a hub id) instead of random
    weights: the frozen base is exactly the checkpoint's, and the adapters train on top of it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(123)
    saved = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    saved.save_pretrained(tmp_path)
    recipe = qlora.Recipe(nf4=False, prepare_kbit=False, checkpointing=False)
    loaded = qlora.build_model(config, recipe, "cpu", weights=tmp_path)
    random = qlora.build_model(config, recipe, "cpu")
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = saved.state_dict()[name]
    assert torch.equal(loaded.get_base_model().state_dict()[name.replace("weight", "base_layer.weight")], expected)
    assert not torch.equal(random.get_base_model().state_dict()[name.replace("weight", "base_layer.weight")], expected)


def test_planner_within_ten_percent_and_tricks_save_memory(config):
    on = qlora.measure_recipe(config, qlora.Recipe(seq=64, accum=2))
    no_quant = qlora.measure_recipe(config, qlora.Recipe(seq=64, accum=2).without("nf4"))
    off = qlora.measure_recipe(config, qlora.Recipe(seq=64, accum=2).all_off())
    for row in (on, no_quant, off):
        assert abs(row.error) < 0.10, (row.label, row.measured_peak, row.predicted_peak)
        assert row.step_ms > 0
    assert on.measured_peak < no_quant.measured_peak < off.measured_peak
    assert on.trainable == no_quant.trainable < off.trainable
    peak_only = qlora.measure_recipe(config, qlora.Recipe(seq=64, accum=2), timed_steps=0)
    assert (peak_only.measured_peak, peak_only.step_ms) == (
        on.measured_peak,
        None,
    )  # exact on a CPU: untimed, same peak
    assert "-" in qlora.format_ablation([on, peak_only]).splitlines()[-1].split()[-1]
    with pytest.raises(ValueError, match="timed_steps"):
        qlora.measure_recipe(config, qlora.Recipe(seq=64), timed_steps=-1)


def test_the_t4_ablation_is_predicted_in_the_t4s_precision_and_runs_nothing(config, monkeypatch):
    """Lesson 5's T4 table: one row per ablation case, each the planner's plan of that case in a T4's
    precision (fp16 autocast), nothing measured; a row past the card has a verdict and no reserved peak."""
    monkeypatch.setattr(ABLATION, "measure_recipe", None)  # nothing may be run
    recipe = qlora.Recipe(seq=64, accum=2)
    rows = qlora.predicted_ablation(config, recipe)
    cases = ABLATION.ablation_cases(recipe)
    assert [r.label for r in rows] == [label for label, _ in cases] and rows[0].recipe == recipe
    for row, (_, case) in zip(rows, cases):
        planned = qlora.predict(config, case, T4, gpu=get_gpu("t4"))
        assert row.measured_peak is None and row.predicted_peak == planned.total - planned.bytes["overhead"]
        assert row.status == "predicted to fit a T4" and row.predicted_reserved == planned.reserved
    assert rows[-1].predicted_peak > rows[0].predicted_peak
    past = qlora.Row("too big", recipe, None, 2 * rows[0].predicted_peak, None, 1, "predicted not to fit a T4")
    table = qlora.format_predicted_ablation([rows[0], past]).splitlines()
    assert table[0].split() == ["configuration", "allocated", "reserved", "x", "all-on", "verdict"]
    assert table[2].split()[4:8] == ["-", "2.00", "predicted", "not"]  # "too big", its allocated: 4 words


def test_rows_that_cannot_run_on_the_gpu_say_why(config, monkeypatch):
    """On CUDA a recipe predicted not to fit is skipped, and an out-of-memory error becomes a row: the
    control flow, checked on the CPU with the CUDA calls replaced."""
    from course_lib.planner import GPU, get_gpu

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**40, 2**40))
    tiny = GPU("tiny", 2**20, (7, 5))  # 1 MiB: less than the CUDA context the planner adds
    skipped = qlora.measure_recipe(config, qlora.Recipe(), "cuda", gpu=tiny, policy=T4)
    assert skipped.status == "predicted not to fit" and skipped.measured_peak is None and skipped.error is None

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(qlora.measuring, "_measure", out_of_memory)
    failed = qlora.measure_recipe(config, qlora.Recipe(), "cuda", gpu=get_gpu("t4"), policy=T4, label="on")
    assert failed.status == "out of memory" and failed.measured_peak is None
    assert failed.predicted_peak == skipped.predicted_peak  # the same recipe and policy, predicted alike
    table = qlora.format_ablation([failed, skipped])
    assert "(out of memory)" in table and "(predicted not to fit)" in table


def test_gpu_settings_need_cuda(config):
    from course_lib.planner import get_gpu

    with pytest.raises(ValueError, match="needs device='cuda'"):
        qlora.measure_recipe(config, qlora.Recipe(), "cpu", gpu=get_gpu("t4"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            qlora.emulate_t4()


def test_on_cuda_every_ablation_row_goes_to_a_process_of_its_own(config, monkeypatch):
    """The parent saves one checkpoint and sends each row to `isolate.run`: checked on the CPU with the
    child replaced by a fake; a child that dies becomes a row that says so."""
    from course_lib import isolate

    calls = []

    def fake(target, **kw):
        calls.append((target, kw))
        if len(calls) == 2:
            return {"status": "crashed", "error": "CUDA error: an illegal memory access", "pid": None}
        row = qlora.Row(kw["label"], qlora.Recipe(**kw["recipe"]), 1, 1, 1.0, 1)
        return {"status": "ok", "row": asdict(row), "pid": len(calls)}

    monkeypatch.setattr(isolate, "run", fake)
    recipe = qlora.Recipe(seq=16, accum=2)
    rows = qlora.ablation(config, recipe, "cuda", as_t4=True)
    assert len(calls) == len(rows) >= 7
    assert {target for target, _ in calls} == {"course_lib.qlora.gpu_rows:measure_row"}
    assert len({kw["config_dir"] for _, kw in calls}) == 1 and all(kw["as_t4"] for _, kw in calls)
    assert [kw["label"] for _, kw in calls] == [r.label for r in rows]
    assert rows[1].status.startswith("crashed") and rows[1].measured_peak is None and rows[1].predicted_peak > 0
    with pytest.raises(ValueError, match="as_t4"):
        qlora.ablation(config, recipe, "cuda", policy=T4)


def test_an_isolated_row_runs_in_a_child_process_and_measures_the_same(config):
    recipe = qlora.Recipe(seq=32, accum=1)
    [child] = qlora.isolated_rows(config, [("all on", recipe)], "cpu")
    here = qlora.measure_recipe(config, recipe, weights=qlora.checkpoint_dir(config))
    assert child.status == "measured" and child.label == "all on"
    assert child.measured_peak == here.measured_peak and child.predicted_peak == here.predicted_peak


def test_trainer_loss_decreases(config):
    data = qlora.counting_dataset(32, 32, 16)
    result = qlora.train(config, qlora.Recipe(seq=32, accum=2), data, max_steps=8, learning_rate=1e-2)
    assert len(result.losses) == 8
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3


def test_train_rejects_a_dataset_smaller_than_one_effective_batch(config):
    with pytest.raises(ValueError, match="fewer than one effective batch"):
        qlora.train(config, qlora.Recipe(accum=4), qlora.counting_dataset(2, 8, 16), max_steps=1)


# ---------------------------------------------------------------------------------------------------
# The exercise's check
# ---------------------------------------------------------------------------------------------------


def test_check_fit_in_budget_measures_and_fails_with_hints(config):
    from course_lib import checks

    def wrong_batch(config, budget, effective_batch, seq):
        return qlora.Recipe(batch=2, accum=1, seq=seq)

    def no_tricks(config, budget, effective_batch, seq):
        return qlora.Recipe(seq=seq, batch=effective_batch, accum=1).all_off()

    def every_trick(config, budget, effective_batch, seq):
        return qlora.Recipe(seq=seq, batch=1, accum=effective_batch)

    with pytest.raises(AssertionError, match="effective batch"):
        checks.check_fit_in_budget(wrong_batch, config, 2**30, effective_batch=4, seq=32)
    with pytest.raises(AssertionError, match="over the budget"):
        checks.check_fit_in_budget(no_tricks, config, 4 * 2**20, effective_batch=4, seq=32)
    with pytest.raises(AssertionError, match="return a qlora.Recipe"):
        checks.check_fit_in_budget(lambda *a: None, config, 2**30, effective_batch=4, seq=32)
    with pytest.raises(AssertionError, match="fits without"):  # a GiB needs no trick at all
        checks.check_fit_in_budget(every_trick, config, 2**30, effective_batch=4, seq=32)
    with pytest.raises(AssertionError, match="does not show"):  # right for the shown budget, not for a hidden one
        checks.check_fit_in_budget(no_tricks, config, 2**30, effective_batch=4, seq=32)


def test_the_random_checkpoint_is_saved_once_for_every_process(config, tmp_path, monkeypatch):
    """With COURSE_LIB_CHECKPOINTS set (gpu_check.sh sets it), a second process finds the checkpoint the
    first one saved instead of writing it again."""
    monkeypatch.setenv("COURSE_LIB_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(qlora.building, "_SAVED", {})
    first = qlora.checkpoint_dir(config)
    stamp = (first / "config.json").stat().st_mtime_ns
    monkeypatch.setattr(qlora.building, "_SAVED", {})  # as in a fresh process
    again = qlora.checkpoint_dir(config)
    assert again == first and first.parent == tmp_path and (again / "config.json").stat().st_mtime_ns == stamp


def test_a_shared_checkpoint_with_only_its_config_is_written_again_whole(config, tmp_path, monkeypatch):
    """save_pretrained writes config.json before the weights: a process killed in between leaves a folder
    that must not be trusted. A whole one is written beside it, then renamed over it."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("COURSE_LIB_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(qlora.building, "_SAVED", {})
    torn = qlora.checkpoint_dir(config)
    for weights in torn.glob("model*.safetensors*"):
        weights.unlink()
    monkeypatch.setattr(qlora.building, "_SAVED", {})
    again = qlora.checkpoint_dir(config)
    assert again == torn and any(again.glob("model*.safetensors*"))
    assert not list(tmp_path.glob(".partial-*"))
    AutoModelForCausalLM.from_pretrained(again)  # loads


def test_the_skip_gate_counts_the_cuda_context_once(config, monkeypatch):
    """CUDA's free memory is after the context: it is compared with the plan without its context."""
    from course_lib.planner import GPU

    row_of = {}
    monkeypatch.setattr(qlora.measuring, "_measure", lambda *args, **kw: row_of.setdefault("ran", args[6]))
    recipe = qlora.Recipe()
    predicted = qlora.predict(config, recipe, T4, gpu=GPU("big", 2**40, (7, 5)))
    peak = predicted.total - predicted.bytes["overhead"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(peak / 0.9), 2**40))
    assert qlora.measure_recipe(config, recipe, "cuda", gpu=GPU("big", 2**40, (7, 5)), policy=T4) == peak
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(0.9 * peak), 2**40))
    skipped = qlora.measure_recipe(config, recipe, "cuda", gpu=GPU("big", 2**40, (7, 5)), policy=T4)
    assert skipped.status == "predicted not to fit"


def test_a_cuda_row_carries_the_planners_reserved_prediction_beside_the_measured_one(config, monkeypatch):
    """The GPU check records max_memory_reserved beside the planner's reserved figure for each row."""
    from course_lib.planner import GPU

    seen = {}
    monkeypatch.setattr(qlora.measuring, "_measure", lambda *args, **kw: seen.update(kw) or "measured")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**40, 2**40))
    big = GPU("big", 2**40, (7, 5))
    assert qlora.measure_recipe(config, qlora.Recipe(), "cuda", gpu=big, policy=T4) == "measured"
    predicted = qlora.predict(config, qlora.Recipe(), T4, gpu=big)
    assert seen["predicted_reserved"] == predicted.reserved >= predicted.total - predicted.bytes["overhead"]
    monkeypatch.undo()
    on_cpu = qlora.measure_recipe(config, qlora.Recipe(), "cpu", timed_steps=0)
    assert on_cpu.predicted_reserved is None and on_cpu.measured_reserved is None and on_cpu.measured_peak > 0


def test_expandable_segments_children_get_the_setting_under_both_names(monkeypatch):
    envs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qlora.gpu_rows, "checkpoint_dir", lambda config: "/nowhere")
    monkeypatch.setattr(qlora.gpu_rows.isolate, "run", lambda target, **kw: envs.append(kw["env"]) or {})
    qlora.expandable_segments_effect("tiny")
    assert [env["PYTORCH_ALLOC_CONF"] for env in envs] == ["expandable_segments:False", "expandable_segments:True"]
    assert all(env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] for env in envs)
