"""Tests of course_lib.planner, the planner (lesson 1): model states exact to the byte against real
optimizers and real quantized layers, activations against measured training steps, the
checkpointing cost model as the one source of truth, the GPU catalog and "what makes it fit"."""

import contextlib
import math
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_lib import planner
from course_lib.measure import measure_step, storage_bytes
from course_lib.models import build_model, spec_from_model
from course_lib.planner import PlanError, Setup, nf4_bytes, optimizer_state_bytes, plan
from course_lib.toolbox import chunked_causal_lm_loss

shapes = st.lists(
    st.one_of(st.tuples(st.integers(1, 300)), st.tuples(st.integers(1, 90), st.integers(1, 90))), min_size=1, max_size=4
)


def _stepped(make_optimizer, shape_list, dtype=torch.float32):
    """Parameters of these shapes and their optimizer after one step (its state made)."""
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shape_list]
    optimizer = make_optimizer(params)
    for p in params:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.step()
    return params, optimizer


def _real_state_bytes(make_optimizer, shape_list, dtype=torch.float32):
    _, optimizer = _stepped(make_optimizer, shape_list, dtype)
    return storage_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


# --- the brief's numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["mixed-bf16", "fp32", "mixed-fp16"])
def test_seven_billion_with_adam_is_112_gb(precision):
    result = plan(7e9, precision=precision, optimizer="adamw")
    assert result.bytes["total"] == 112_000_000_000
    assert result.bytes["activations"] == 0 and not result.activations_known
    assert sum(result.bytes[c] for c in planner.CATEGORIES if c != "total") == result.total


def test_mixed_precision_is_2_2_8_4():
    b = plan(1000, precision="mixed-bf16").bytes
    assert (b["weights"], b["gradients"], b["optimizer_state"], b["master_weights"]) == (2000, 2000, 8000, 4000)


def test_seventy_billion_is_about_1_1_tb():
    assert plan(70e9).total == 1_120_000_000_000


@pytest.mark.parametrize(
    "optimizer, per_param", [("sgd", 4), ("momentum", 8), ("adamw", 12), ("lion", 8), ("paged_adamw32bit", 12)]
)
def test_fp32_bytes_per_parameter(optimizer, per_param):
    assert plan(10**6, precision="fp32", optimizer=optimizer).total == per_param * 10**6 + 4 * 10**6


def test_pure_bf16_adam_keeps_state_in_bf16_unless_asked():
    assert plan(1000, precision="bf16").total == 2000 + 2000 + 4000
    assert plan(1000, precision="bf16", adam_state="fp32").total == 2000 + 2000 + 8000


# --- optimizer state: exact against the real optimizers ------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes)
def test_torch_adamw_state_is_exact(shape_list):
    numels = [math.prod(s) for s in shape_list]
    assert optimizer_state_bytes("adamw", numels, 4) == _real_state_bytes(torch.optim.AdamW, shape_list)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes)
def test_torch_adafactor_state_is_exact(shape_list):
    numels = [math.prod(s) for s in shape_list]
    real = _real_state_bytes(torch.optim.Adafactor, shape_list)
    assert optimizer_state_bytes("adafactor", numels, 4, shape_list) == real


def test_momentum_state_is_exact():
    shape_list = [(30, 7), (5,)]
    real = _real_state_bytes(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), shape_list)
    assert optimizer_state_bytes("momentum", [210, 5], 4) == real


bnb = pytest.importorskip("bitsandbytes")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.sampled_from([(7,), (4095,), (4096,), (4097,), (64, 100), (300, 40), (257, 33)]), min_size=1, max_size=3
    )
)
def test_bitsandbytes_8bit_state_is_exact_with_small_tensor_fallback(shape_list):
    numels = [math.prod(s) for s in shape_list]
    for name, cls in (("adamw8bit", bnb.optim.AdamW8bit), ("paged_adamw8bit", bnb.optim.PagedAdamW8bit)):
        assert optimizer_state_bytes(name, numels, 4) == _real_state_bytes(cls, shape_list)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adamw", "adafactor", "lion", "paged_adamw32bit", "adamw8bit"])
def test_each_state_tensor_of_each_parameter_is_the_real_optimizers(name):
    """`state_tensor_bytes` (what the reserved prediction replays through the caching allocator) lists the
    real optimizer's state tensors of each parameter, one by one (Lion one, AdamW two, 8-bit AdamW two
    uint8 states and two absmax; the step counters, 8-bit AdamW's shared quantization maps and Adafactor's
    RMS scalar are the per-optimizer extras `optimizer_state_bytes` adds)."""
    from transformers.optimization import Adafactor

    from course_lib.planner.states.model_states import state_tensor_bytes

    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": torch.optim.AdamW,
        "adafactor": lambda p: Adafactor(p, lr=1e-3, relative_step=False),
        "lion": bnb.optim.Lion,
        "paged_adamw32bit": bnb.optim.PagedAdamW32bit,
        "adamw8bit": bnb.optim.AdamW8bit,
    }[name]
    shape_list = [(64, 100), (5000,), (3, 4, 5), (10,)]  # 8-bit AdamW: 32-bit state below 4096 elements
    params, optimizer = _stepped(make, shape_list)
    for p, shape in zip(params, shape_list):
        real = sorted(
            v.untyped_storage().nbytes()
            for k, v in optimizer.state[p].items()
            if isinstance(v, torch.Tensor) and k not in ("step", "qmap1", "qmap2", "RMS")
        )
        assert real == sorted(state_tensor_bytes(name, shape, 4)), (shape, real)


def test_8bit_adam_is_2_03_bytes_per_parameter_on_a_large_tensor():
    n = 2**20
    assert optimizer_state_bytes("adamw8bit", [n], 4) == 2 * n + 8 * n // 256 + 2048
    assert optimizer_state_bytes("adamw8bit", [100], 4) == 800  # below 4096 elements: 32-bit state


@pytest.mark.parametrize("name, cls", [("paged_adamw32bit", "PagedAdamW32bit"), ("lion", "Lion")])
def test_bitsandbytes_32bit_state_is_fp32_even_for_bf16_params(name, cls):
    shape_list = [(64, 100), (10,)]
    real = _real_state_bytes(getattr(bnb.optim, cls), shape_list, torch.bfloat16)
    assert optimizer_state_bytes(name, [6400, 10], 2) == real


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 200), st.integers(1, 300), st.booleans())
def test_nf4_bytes_are_exact_against_a_real_quantized_layer(rows, cols, double_quant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight = bnb.nn.Params4bit(
            torch.randn(rows, cols), requires_grad=False, compress_statistics=double_quant, quant_type="nf4"
        )._quantize("cpu")
    state = weight.quant_state
    meta = [state.absmax, state.code]
    if double_quant:
        meta += [state.offset, state.state2.absmax, state.state2.code]
    assert nf4_bytes(rows * cols, double_quant) == (storage_bytes([weight]), storage_bytes(meta))


# --- activations and peaks: against measured training steps -------------------------------------


def _tiny_llama(tied: bool = False):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama",
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        tie_word_embeddings=tied,
    )


def _tiny_llama_step(
    setup: Setup, make_optimizer=torch.optim.AdamW, first_step=contextlib.nullcontext, tied: bool = False
):
    """A seeded tiny Llama on the CPU trained as `setup` says (checkpointing, autocast for amp-*), its
    step 2 measured (step 1 makes the optimizer state, under `first_step(model)`) and the plan of the same
    setup: (model, measured, predicted)."""
    config = _tiny_llama(tied)
    torch.manual_seed(0)
    model = build_model(config, "cpu", dtype=setup.weight_dtype)
    model.train()
    if setup.checkpointing != "none":
        with warnings.catch_warnings():  # transformers 5.23 renames it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(model.parameters())
    ids = torch.randint(0, 2048, (setup.batch, setup.seq))
    labels = ids.clone()

    def loss_fn():
        with torch.autocast("cpu", dtype=setup.autocast_dtype, enabled=setup.autocast_dtype is not None):
            if setup.chunked_loss is not None:  # lesson 7's, each chunk recomputed in backward
                return chunked_causal_lm_loss(model, ids, labels, setup.chunked_loss)
            return model(input_ids=ids, labels=labels, use_cache=False).loss

    with first_step(model):
        measure_step(model, optimizer, loss_fn, [ids, labels])
    measured = measure_step(model, optimizer, loss_fn, [ids, labels])
    return model, measured, plan(spec_from_model(build_model(config), "tiny-llama", config), setup)


@pytest.mark.parametrize("checkpointing, precision", [("none", "fp32"), ("every-layer", "fp32"), ("none", "bf16")])
def test_peak_matches_a_measured_step_within_2_percent(checkpointing, precision):
    setup = Setup(precision=precision, optimizer="adamw", batch=2, seq=96, checkpointing=checkpointing)
    _, measured, predicted = _tiny_llama_step(setup)
    assert predicted.bytes["weights"] == measured.parameters
    assert predicted.detail["all_gradients"] == measured.gradients
    assert predicted.bytes["optimizer_state"] == measured.optimizer_state
    assert abs(predicted.total - measured.peak) <= 0.02 * measured.peak
    _assert_phases_match(predicted, measured)


def _assert_phases_match(predicted, measured):
    """Each phase's planned peak (the categories live then, `plots.phase_bytes`) is the measured phase's,
    and the plan's categories are those of the phase that holds its peak."""
    planned = {name: sum(live.values()) for name, live in predicted.by_phase().items()}
    for name, phase in (("end of forward", "forward"), ("backward", "backward"), ("optimizer step", "optimizer")):
        assert abs(planned[name] - measured.phase_peaks[phase]) <= 0.02 * measured.peak, (name, planned, measured)
    assert predicted.total == max(planned.values())
    assert sum(predicted.bytes[c] for c in predicted.bytes if c != "total") == predicted.total


def test_peft_lora_dropout_is_planned_within_2_percent_of_the_measured_step():
    """lora_dropout > 0 makes peft keep a dropped copy of each adapter's input and its noise (lesson 1)."""
    from peft import LoraConfig, get_peft_model

    config = _tiny_llama()
    ids = torch.randint(0, 2048, (2, 96))
    peaks = {}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        model = get_peft_model(
            build_model(config, "cpu"),
            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=dropout),
        )
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

        def loss_fn():
            return model(input_ids=ids, labels=ids, use_cache=False).loss

        measure_step(model, optimizer, loss_fn, [ids])
        measured = measure_step(model, optimizer, loss_fn, [ids]).peak
        setup = Setup(precision="fp32", optimizer="adamw", lora_rank=8, lora_dropout=dropout, batch=2, seq=96)
        predicted = plan(spec_from_model(build_model(config), "tiny-llama", config), setup).total
        assert abs(predicted - measured) <= 0.02 * measured, (dropout, predicted, measured)
        peaks[dropout] = measured
    assert peaks[0.1] > peaks[0.0]


def test_checkpointing_goes_through_lesson_3s_cost_model(monkeypatch):
    from course_lib import checkpointing

    calls = []
    real = checkpointing.plan_cost

    def spy(saved, inputs, boundaries, **kwargs):
        calls.append(list(boundaries))
        return real(saved, inputs, boundaries, **kwargs)

    monkeypatch.setattr(checkpointing, "plan_cost", spy)
    plan("gpt2", precision="fp32", batch=1, seq=128, checkpointing="sqrt")
    assert checkpointing.named_plan(12, "sqrt") in calls  # GPT-2 small has 12 layers


def test_checkpointing_lowers_the_peak_of_a_real_decoder_and_reports_recompute():
    none = plan("gpt2", precision="fp32", batch=4, seq=512)
    every = plan("gpt2", precision="fp32", batch=4, seq=512, checkpointing="every-layer")
    assert every.bytes["activations"] < none.bytes["activations"]
    assert every.detail["recompute_fraction"] == 1.0 and none.detail["recompute_fraction"] == 0.0


def test_activations_grow_with_batch_and_sequence_and_eager_pays_the_square():
    small = plan("gpt2", precision="fp32", batch=1, seq=128, attention="sdpa").detail["saved_for_backward"]
    double_batch = plan("gpt2", precision="fp32", batch=2, seq=128, attention="sdpa").detail["saved_for_backward"]
    assert double_batch > 1.9 * small
    llama = plan("llama-3.2-1b", batch=1, seq=1024, attention="sdpa").detail["saved_per_layer"]
    llama_eager = plan("llama-3.2-1b", batch=1, seq=1024, attention="eager").detail["saved_per_layer"]
    assert llama_eager > llama + 32 * 1024 * 1024 * 2  # heads x s x s bf16 scores at least


def test_a_dropout_keeps_a_one_byte_mask_on_cuda_and_noise_of_the_inputs_dtype_on_the_cpu():
    """What backward keeps of a training dropout: on the CPU (and on meta) a noise tensor of the input's
    dtype, on CUDA the 1-byte mask of its fused kernel (aten/src/ATen/native/Dropout.cpp: `dropout`
    runs `native_dropout` on CUDA)."""
    from transformers import AutoConfig

    from course_lib.planner.trace.step import trace_in_full

    def saved(p: float, target: str) -> int:
        config = AutoConfig.for_model(
            "gpt2",
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=512,
            n_positions=64,
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        trace = trace_in_full(
            spec_from_model(build_model(config), "tiny-gpt2", config), Setup(precision="fp32", batch=2, seq=32), target
        )
        return sum(trace.saved) + trace.saved_outside

    elements = (2 * 2 + 1) * 2 * 32 * 64  # two residual dropouts a layer and one after the embeddings
    assert saved(0.1, "cpu") - saved(0.0, "cpu") == 4 * elements
    assert saved(0.1, "cuda") - saved(0.0, "cuda") == elements


def test_accumulation_keeps_gradients_alive_during_the_forward():
    one = plan("gpt2", precision="fp32", batch=2, seq=256)
    four = plan("gpt2", precision="fp32", batch=2, seq=256, accum=4)
    assert four.total > one.total


def test_lora_trains_few_parameters_and_qlora_stores_half_a_byte():
    lora = plan("llama-3.2-1b", precision="bf16", lora_rank=16, batch=1, seq=256)
    assert lora.trainable_params < 0.02 * lora.n_params
    assert lora.detail["all_gradients"] == 4 * lora.trainable_params  # fp32 adapters
    assert (
        lora.bytes["gradients"] == 0 and lora.detail["peak_phase"] == "head backward"
    )  # its peak, in the head's backward, comes before any adapter's gradient
    qlora = plan("llama-3.2-1b", precision="bf16", lora_rank=16, quant="nf4-dq", batch=1, seq=256)
    assert qlora.bytes["weights"] < 0.6 * lora.bytes["weights"]
    assert (
        0
        < qlora.bytes["quantization"]
        < plan("llama-3.2-1b", precision="bf16", lora_rank=16, quant="nf4", batch=1, seq=256).bytes["quantization"]
    )


def test_korthikanti_formula():
    assert planner.korthikanti_bytes(1, 2048, 4096, 32, 1) == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)


# --- GPUs, verdicts, tricks -----------------------------------------------------------------------


def test_catalog_has_the_required_gpus_and_the_t4_shows_15_gib():
    for name in ("t4", "l4", "a10g", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "rtx3090", "rtx4090"):
        assert planner.get_gpu(name)
    from course_lib.planner.config.command import help_text

    help_text = help_text()
    assert all(name in help_text for name in planner.GPUS), "course-lib plan --help must list every catalog GPU"
    assert planner.get_gpu("T4").memory_bytes == 15 * 2**30
    assert not planner.get_gpu("t4").bf16 and planner.get_gpu("a100").bf16


def test_gpu_target_adds_the_cuda_context_and_a_verdict():
    result = plan(10**6, precision="fp32", gpu="t4")
    assert result.bytes["overhead"] == planner.CUDA_CONTEXT_BYTES and result.fits
    assert "fits on T4" in result.verdict()


@pytest.mark.parametrize(
    "options",
    [
        dict(precision="mixed-fp16", batch=4, seq=1024),
        dict(precision="mixed-fp16", batch=2, seq=1024),
        dict(precision="mixed-fp16", batch=16, seq=512),
    ],
)
def test_what_makes_it_fit_keeps_only_the_tricks_the_final_setup_needs(options):
    model = "llama-3.2-1b" if options["batch"] == 4 else "llama-3.1-8b"
    result = plan(model, gpu="t4", **options)
    assert not result.fits and result.tricks
    final = plan(model, result.tricks[-1].setup, gpu="t4", suggest=False)
    assert final.fits and final.total == result.tricks[-1].total_after
    assert result.tricks[-1].fits_after and not any(t.fits_after for t in result.tricks[:-1])
    for trick in result.tricks:  # pruned: without any one of them the final setup does not fit (or is refused)
        assert trick.saves is None or final.total + trick.saves > final.gpu.memory_bytes
    qlora = any(t.name.startswith("QLoRA") for t in result.tricks)  # only LoRA under QLoRA cannot go alone
    assert [t.name for t in result.tricks if t.saves is None] == [
        t.name for t in result.tricks if qlora and t.name.startswith("LoRA")
    ]


def test_what_makes_it_fit_tries_exact_tricks_before_lossy_ones_and_prunes_what_a_later_one_made_unneeded():
    """Llama-3.1-8B on a T4 at batch 2 x 1024: the 4-bit recipe fits at batch 2, so no accumulation
    (the old list kept "accumulation x2"); the chunked loss, exact, is kept where it is needed."""
    result = plan("llama-3.1-8b", precision="mixed-fp16", batch=2, seq=1024, gpu="t4")
    names = [t.name for t in result.tricks]
    assert not any("accumulation" in name for name in names) and result.tricks[-1].setup.batch == 2
    assert "activation checkpointing (every layer)" in names and names[-1].startswith("QLoRA")
    candidates = [
        name
        for name, _, exact in planner.search.fit._candidate_tricks(
            Setup(precision="mixed-fp16", batch=2), planner.get_gpu("t4")
        )
    ]
    lossy_from = candidates.index("8-bit AdamW (bitsandbytes)")
    assert all(name.startswith(("8-bit", "LoRA", "QLoRA")) for name in candidates[lossy_from:])
    assert "fused AdamW (fused=True, the Trainer's adamw_torch_fused)" in candidates[:lossy_from]
    assert "chunked loss (1024 tokens a chunk)" in candidates[:lossy_from]


def test_fused_adamw_keeps_adamw_s_state_and_makes_no_step_temporaries():
    fused = plan("llama-3.2-1b", optimizer="adamw_fused", precision="bf16", gpu="a100-80gb", suggest=False)
    foreach = plan("llama-3.2-1b", optimizer="adamw", precision="bf16", gpu="a100-80gb", suggest=False)
    assert fused.bytes["optimizer_state"] == foreach.bytes["optimizer_state"]
    assert fused.detail["optimizer_step_temporaries"] == 0 < foreach.detail["optimizer_step_temporaries"]
    assert fused.total < foreach.total


def test_fused_adamw_is_planned_within_1_percent_of_a_measured_step():
    setup = Setup(precision="fp32", optimizer="adamw_fused", batch=2, seq=96)
    _, measured, predicted = _tiny_llama_step(setup, lambda params: torch.optim.AdamW(params, fused=True))
    assert predicted.bytes["optimizer_state"] == measured.optimizer_state
    assert abs(predicted.total - measured.peak) <= 0.01 * measured.peak


def test_bitsandbytes_cpu_step_temporaries_are_planned_as_the_allocator_measures_them():
    """bitsandbytes' CPU 8-bit step makes five fp32 copies of each parameter inside one operator
    (lesson 0, "6. Checking the instrument"): the planner counts them on a CPU target, not on CUDA."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from course_lib.toolbox import embeddings_in_32_bits

    setup = Setup(precision="fp32", optimizer="adamw8bit", batch=2, seq=96)
    # the Trainer's 32-bit embeddings, as the planner plans them
    model, measured, predicted = _tiny_llama_step(setup, bnb.optim.AdamW8bit, embeddings_in_32_bits)
    largest = max(p.numel() for p in model.parameters())  # the output layer's, as large as the embeddings'
    assert predicted.bytes["optimizer_state"] == measured.optimizer_state
    unseen = measured.phase_peaks["optimizer"] - measured.tracked_phase_peaks["optimizer"]
    assert unseen == pytest.approx(20 * largest, rel=0.01)  # five fp32 copies of the largest tensor
    assert predicted.detail["optimizer_step_temporaries"] == 20 * largest
    assert abs(predicted.total - measured.peak) <= 0.01 * measured.peak
    config = _tiny_llama()
    spec = spec_from_model(build_model(config), "tiny-llama", config)
    assert plan(spec, setup, gpu="a100-80gb", suggest=False).detail["optimizer_step_temporaries"] == 0


def test_an_embedding_the_trainer_keeps_in_32_bits_takes_bitsandbytes_32_bit_cpu_kernel():
    """Tied embeddings (GPT-2, Qwen2, Gemma-2): the largest tensor is the embedding, which the Trainer has
    AdamW8bit keep in 32 bits, so its CPU step is the 32-bit kernel's three fp32 copies, not the 8-bit
    kernel's five (the CPU accuracy matrix's fp32 AdamW8bit rows at sequence 64 were 11-20% high)."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from course_lib.toolbox import embeddings_in_32_bits

    setup = Setup(precision="fp32", optimizer="adamw8bit", batch=2, seq=96)
    model, measured, predicted = _tiny_llama_step(setup, bnb.optim.AdamW8bit, embeddings_in_32_bits, tied=True)
    embedding = model.get_input_embeddings().weight.numel()
    others = max(p.numel() for p in model.parameters() if p.numel() != embedding)
    assert predicted.detail["optimizer_step_temporaries"] == max(12 * embedding, 20 * others) < 20 * embedding
    unseen = measured.phase_peaks["optimizer"] - measured.tracked_phase_peaks["optimizer"]
    assert unseen == pytest.approx(max(12 * embedding, 20 * others), rel=0.01)
    assert abs(predicted.total - measured.peak) <= 0.01 * measured.peak


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(batch=0), "batch must be a whole number >= 1, got 0"),
        (dict(seq=-3), "seq must be a whole number >= 1, got -3"),
        (dict(precision="fp8"), "unknown precision"),
        (dict(optimizer="adam"), "unknown optimizer"),
        (dict(quant="nf4"), "--lora-rank"),
        (dict(quant="nf4", lora_rank=8, precision="mixed-bf16"), "no fp32"),
        (dict(checkpointing="every-0"), "K in every-K"),
        (dict(checkpointing="half"), "unknown checkpointing plan"),
    ],
)
def test_bad_setups_are_refused_with_a_reason(options, message):
    with pytest.raises(PlanError, match=message):
        plan("gpt2", **options)


def test_bad_gpu_and_bf16_on_a_t4_are_refused():
    with pytest.raises(PlanError, match="did you mean"):
        plan(1000, gpu="t5")
    with pytest.raises(PlanError, match="no bf16 hardware"):
        plan(1000, precision="mixed-bf16", gpu="t4")


@pytest.mark.parametrize("count", [0, -1, 1.5, float("nan")])
def test_non_positive_counts_are_refused(count):
    with pytest.raises(PlanError, match="positive whole number"):
        plan(count)


def test_optimizer_temporaries_are_their_own_category_and_prepare_kbit_costs_memory():
    """The foreach AdamW step's sqrt(v) is counted apart from activations (what it adds over their peak),
    and "what makes it fit" takes QLoRA as peft's recipe does it: prepare_model_for_kbit_training upcasts
    the output layer to fp32, which fp16 autocast then re-casts at every call (lesson 5)."""
    setup = planner.Setup(precision="fp32", batch=1, seq=64, checkpointing="every-layer")
    foreach = plan("gpt2", setup, gpu="A100-80GB")
    eight = plan("gpt2", replace(setup, optimizer="adamw8bit"), gpu="A100-80GB")
    assert foreach.bytes["optimizer_temporaries"] > 0 and eight.bytes["optimizer_temporaries"] == 0
    assert sum(foreach.bytes[c] for c in planner.CATEGORIES if c != "total") == foreach.total
    qlora = dict(
        precision="fp16",
        lora_rank=16,
        quant="nf4-dq",
        batch=1,
        seq=128,
        checkpointing="every-layer",
        optimizer="adamw8bit",
    )
    plain = plan("llama-3.2-1b", gpu="t4", prepare_kbit=False, **qlora)
    prepared = plan("llama-3.2-1b", gpu="t4", prepare_kbit=True, **qlora)
    assert prepared.total > plain.total and prepared.detail["autocast_copies"] > 0 == plain.detail["autocast_copies"]
    trick = plan("llama-3.1-8b", planner.Setup(precision="mixed-fp16", batch=16, seq=512), gpu="t4").tricks[-1]
    assert "prepare_model_for_kbit_training" in trick.name and trick.setup.prepare_kbit


# --- the Trainer's mixed precision (amp-*): fp32 weights and gradients, torch.autocast ------------


def _autocast_cases():
    """(name, call) pairs: each call takes (x, w, y) (x, w fp32, y bf16) and returns one tensor."""
    F = torch.nn.functional
    target = torch.zeros(4, dtype=torch.long)
    return [
        ("linear", lambda x, w, y: F.linear(x, w)),
        ("matmul", lambda x, w, y: torch.matmul(x, w.T)),
        ("@", lambda x, w, y: x @ w.T),
        ("mm", lambda x, w, y: x.mm(w.T)),
        ("bmm", lambda x, w, y: torch.bmm(x[None], w.T[None])),
        ("addmm", lambda x, w, y: torch.addmm(w[:, 0], x, w.T)),
        ("baddbmm", lambda x, w, y: torch.baddbmm(w[None, :4, :6], x[None], w.T[None])),
        ("conv1d", lambda x, w, y: F.conv1d(x[None], w[:, :4, None])),
        ("sdpa", lambda x, w, y: F.scaled_dot_product_attention(x[None], x[None], x[None])),
        ("cross_entropy", lambda x, w, y: F.cross_entropy(y, target.to(y.device))),
        ("mse_loss", lambda x, w, y: F.mse_loss(y, y)),
        ("prod", lambda x, w, y: torch.prod(y)),
        ("pow", lambda x, w, y: torch.pow(y, 2)),
        ("**", lambda x, w, y: y**2),
        ("rsqrt", lambda x, w, y: y.rsqrt()),
        ("softmax", lambda x, w, y: F.softmax(y, -1)),
        ("layer_norm", lambda x, w, y: F.layer_norm(y, (8,))),
        ("silu", lambda x, w, y: F.silu(y)),
        ("tanh", lambda x, w, y: torch.tanh(y)),
        ("sum", lambda x, w, y: y.sum()),
        ("exp", lambda x, w, y: y.exp()),
        ("embedding", lambda x, w, y: F.embedding(target.to(x.device), x)),
        ("cat same", lambda x, w, y: torch.cat([y, y])),
        ("cat mixed", lambda x, w, y: torch.cat([x, y])),
        ("add mixed", lambda x, w, y: x + y),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_autocast_casts_each_op_as_cpu_autocast_does(dtype):
    """The emulation on meta tensors gives every op the dtype that torch.autocast("cpu") gives it on real
    ones, casts included (a cast op changes the dtype; an unlisted op keeps what it is given)."""
    from course_lib.planner.trace.autocast import MetaAutocast

    def inputs(device):
        torch.manual_seed(0)
        return (
            torch.randn(4, 8, device=device),
            torch.randn(6, 8, device=device),
            torch.randn(4, 8, device=device).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float16),
        )

    real = {}
    for name, call in _autocast_cases():
        with torch.autocast("cpu", dtype=dtype):
            real[name] = call(*inputs("cpu")).dtype
        with MetaAutocast(dtype, "cpu"):
            emulated = call(*inputs("meta")).dtype
        assert emulated == real[name], (name, emulated, real[name])
    # the cases test something: matmuls are cast to 16 bits, losses to fp32, the rest keep their input's dtype
    assert real["linear"] == real["@"] == dtype and real["cross_entropy"] == real["prod"] == torch.float32
    assert real["tanh"] == real["layer_norm"] == dtype and real["embedding"] == torch.float32


def test_meta_autocast_caches_one_copy_of_each_trained_weight_and_recasts_frozen_ones():
    """autocast_mode.cpp's cached_cast: an fp32 leaf that requires grad is cast once per region."""
    from course_lib.planner.trace.autocast import MetaAutocast

    copies = []
    trained = torch.nn.Parameter(torch.randn(6, 8, device="meta"))
    frozen = torch.randn(6, 8, device="meta")
    x = torch.randn(4, 8, device="meta")
    with MetaAutocast(torch.bfloat16, "cpu", copies.append) as autocast:
        for _ in range(3):
            torch.nn.functional.linear(x, trained)
            torch.nn.functional.linear(x, frozen)
        assert len(autocast.cache) == 1 and copies == [6 * 8 * 2]
    assert not autocast.cache  # cleared when the region ends, as torch.autocast.__exit__ clears it


def test_amp_keeps_fp32_weights_gradients_and_state_and_no_master_copy():
    amp = plan(1000, precision="amp-bf16").bytes
    mixed = plan(1000, precision="mixed-bf16").bytes
    assert (amp["weights"], amp["gradients"], amp["optimizer_state"], amp["master_weights"]) == (4000, 4000, 8000, 0)
    assert (mixed["weights"], mixed["gradients"], mixed["master_weights"]) == (2000, 2000, 4000)
    assert Setup(precision="amp-fp16").weight_dtype == torch.float32 == Setup(precision="amp-bf16").weight_dtype
    assert (
        Setup(precision="amp-fp16").autocast_dtype == torch.float16
        and Setup(precision="mixed-bf16").autocast_dtype is None
    )


def test_amp_trace_caches_a_16_bit_copy_of_every_linear_weight():
    """Autocast casts the weights of the linear layers (the output layer too), not the embeddings or the
    norms: 2 bytes for each of their parameters, held by the cache through the forward."""
    config = _tiny_llama()
    spec = spec_from_model(build_model(config), "tiny-llama", config)
    trace = planner.trace_step(spec, Setup(precision="amp-bf16", batch=2, seq=96))
    assert sum(trace.autocast_cached) + trace.autocast_cached_outside == 2 * sum(
        p.numel for p in spec.params if p.module == "linear"
    )
    assert (
        len(set(trace.autocast_cached)) == 1 and trace.autocast_cached_outside > 0
    )  # each layer's, the output layer's


@pytest.mark.parametrize("precision", ["amp-bf16", "amp-fp16"])
def test_a_chunked_loss_under_autocast_is_planned_within_2_percent_of_the_measured_step(precision):
    """Each chunk's recompute runs under autocast again (torch restores it for a checkpoint's recompute):
    the planner traced it without its autocast once, and refused the Trainer's default recipe with it."""
    setup = Setup(precision=precision, optimizer="adamw", batch=2, seq=96, chunked_loss=32)
    _, measured, predicted = _tiny_llama_step(setup)
    assert abs(predicted.total - measured.peak) <= 0.02 * measured.peak, (predicted.total, measured.peak)


@pytest.mark.parametrize(
    "precision, checkpointing",
    [("amp-bf16", "none"), ("amp-bf16", "every-layer"), ("amp-fp16", "none"), ("amp-fp16", "every-layer")],
)
def test_amp_plan_matches_a_measured_autocast_step_within_2_percent(precision, checkpointing):
    """fp32 weights and AdamW, the forward under torch.autocast("cpu"), as the Trainer runs bf16=True."""
    setup = Setup(precision=precision, optimizer="adamw", batch=2, seq=96, checkpointing=checkpointing)
    _, measured, predicted = _tiny_llama_step(setup)
    assert predicted.bytes["weights"] == measured.parameters == 4 * predicted.n_params
    assert predicted.detail["all_gradients"] == measured.gradients
    assert predicted.bytes["optimizer_state"] == measured.optimizer_state
    assert abs(predicted.total - measured.peak) <= 0.02 * measured.peak, (predicted.total, measured.peak)
    # the forward, where autocast's cache holds a copy of every weight (checkpointing or not), on its own
    forward = predicted.bytes["weights"] + predicted.bytes["optimizer_state"] + predicted.detail["forward_peak"]
    assert abs(forward - measured.phase_peaks["forward"]) <= 0.02 * measured.phase_peaks["forward"]
    config = _tiny_llama()
    fp32 = plan(spec_from_model(build_model(config), "tiny-llama", config), replace(setup, precision="fp32"))
    assert fp32.detail["forward_peak"] != predicted.detail["forward_peak"]  # autocast changes the activations


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(precision="amp-bf16", quant="nf4", lora_rank=8), "compute dtype; use --precision bf16"),
        (dict(precision="amp-bf16", gpus=2), "plan autocast on one GPU"),
    ],
)
def test_amp_setups_the_planner_does_not_model_are_refused(options, message):
    with pytest.raises(PlanError, match=message):
        plan("gpt2", **options)
    with pytest.raises(PlanError, match="no bf16 hardware: use amp-fp16"):
        plan(1000, precision="amp-bf16", gpu="t4")


@pytest.mark.parametrize(
    "precision, per_param", [("mixed-bf16-fp32grads", (2, 4, 8, 4)), ("mixed-fp16-fp32grads", (2, 6, 8, 4))]
)
def test_megatrons_main_gradient_recipes_are_its_18_and_20_bytes(precision, per_param):
    """Megatron Core's distributed-optimizer table, non-distributed: bf16 + fp32 grads 18, fp16 20 (lesson 1)."""
    b = plan(1000, precision=precision).bytes
    assert tuple(b[c] / 1000 for c in ("weights", "gradients", "optimizer_state", "master_weights")) == per_param
    with pytest.raises(PlanError, match="one GPU") as error:
        plan(1000, precision=precision, gpus=2)
    assert "\n" not in str(error.value)


def test_transformers_adafactor_keeps_fp32_state_for_16_bit_adapters_too():
    """transformers' Adafactor keeps its statistics in fp32 whatever the parameter's dtype, as the full
    fine-tune plans it: bf16 adapters (peft's autocast_adapter_dtype=False) get the same state as fp32 ones."""
    from course_lib.models import model_spec
    from course_lib.planner.states.model_states import model_states

    spec = model_spec("llama-3.2-1b")
    fp32, bf16 = (
        model_states(spec, Setup(precision="bf16", lora_rank=8, optimizer="adafactor", autocast_adapter_dtype=autocast))
        for autocast in (True, False)
    )
    assert bf16.state_itemsize == fp32.state_itemsize == 4
    assert bf16.optimizer_state == fp32.optimizer_state
    assert bf16.weights < fp32.weights  # the adapters themselves are bf16
