"""Lesson 2: gradient accumulation. Equivalence (and where it fails), the reference loop, the checks.

The DDP cross-check is in test_accumulation_ddp.py, the Hugging Face Trainer one in
test_accumulation_trainer.py.
"""

import contextlib
import copy
import functools
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from course_lib import checks
from course_lib.accumulation import (
    DDP_MISTAKES,
    MISTAKES,
    SampleLoss,
    TinyTokenLM,
    TokenLoss,
    collate_padded,
    compare_accumulation,
    compare_batchnorm_remedies,
    concat_batches,
    cost_model,
    demonstrate_mistakes,
    format_cost_table,
    freeze_batchnorm_stats,
    ghost_batchnorm,
    max_weight_difference,
    measure_accumulation_cost,
    padded_token_batches,
    regression_batches,
    replace_batchnorm,
    split_batch,
    tiny_mlp,
    train_whole_windows,
    train_with_accumulation,
    train_with_mistake,
    windows,
)

DDP_ONLY = set(DDP_MISTAKES)
reference_loop = functools.partial(train_with_accumulation, progress=False)


def token_batch(rows=8, seed=1, max_len=12):
    return padded_token_batches(1, batch_size=rows, max_len=max_len, seed=seed)[0]


# ---------------------------------------------------------------------------------------------------
# compare_accumulation: the "Done when" numbers
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_model, batch",
    [
        (lambda: tiny_mlp("layer"), regression_batches(1, batch_size=16)[0]),
        (lambda: TinyTokenLM(norm="layer"), token_batch()),
    ],
    ids=["layernorm-mlp", "layernorm-token-lm"],
)
def test_layernorm_model_accumulates_exactly_in_fp32_and_fp64(make_model, batch):
    report = compare_accumulation(make_model(), batch, k=4)
    assert report["float32"].max_rel_grad < 1e-5
    assert report["float64"].max_rel_grad < 1e-12
    assert report["float32"].buffers == [] and report["float64"].batches_tracked is None
    c = report["float64"]
    assert c.loss_accumulated == pytest.approx(c.loss_whole, rel=1e-12)
    assert len(report["float32"].gradients) == len(list(make_model().parameters()))


def test_padded_tokens_exact_although_token_counts_differ():
    report = compare_accumulation(TinyTokenLM(), token_batch(), k=4)
    assert len(set(report.micro_batch_items)) > 1, "the data must have different token counts per micro-batch"
    assert report["float64"].max_rel_grad < 1e-12


def test_batchnorm_model_differs_in_gradients_and_running_stats():
    k = 4
    report = compare_accumulation(tiny_mlp("batch"), regression_batches(1, batch_size=16)[0], k=k)
    for dtype in ("float32", "float64"):
        c = report[dtype]
        assert c.max_rel_grad > 0.1, "BatchNorm statistics of a micro-batch are not those of the batch"
        assert c.max_running_stat_diff > 1e-3
        assert c.batches_tracked == (1, k)
        names = {b.name for b in c.buffers}
        assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= names
    assert "num_batches_tracked" in report.buffer_table("float32")


def test_batchnorm_in_a_token_model_fails_too():
    report = compare_accumulation(TinyTokenLM(norm="batch"), token_batch(), k=4)
    assert report["float64"].max_rel_grad > 1e-3 and report["float64"].batches_tracked == (1, 4)


def test_naive_mean_differs_with_padding_and_global_count_does_not():
    batch = token_batch()
    naive = compare_accumulation(TinyTokenLM(), batch, 4, normalization="naive")["float64"]
    exact = compare_accumulation(TinyTokenLM(), batch, 4)["float64"]
    assert naive.max_rel_grad > 1e-3 and exact.max_rel_grad < 1e-12
    assert abs(naive.loss_accumulated - naive.loss_whole) > 1e-4
    assert exact.loss_accumulated == pytest.approx(exact.loss_whole, rel=1e-12)


def test_naive_mean_is_exact_when_every_micro_batch_has_the_same_count():
    report = compare_accumulation(tiny_mlp("layer"), regression_batches(1, batch_size=12)[0], 3, normalization="naive")
    assert report["float64"].max_rel_grad < 1e-12


def test_a_gradient_that_is_exactly_zero_is_exact_zero_even_when_every_gradient_is():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())  # every output below 0: ReLU passes no gradient
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(-1.0)
    report = compare_accumulation(model, regression_batches(1, batch_size=8, in_features=4, out_features=3)[0], 2)
    for dtype in ("float32", "float64"):
        gradients = report[dtype].gradients
        assert [g.name for g in gradients] == ["0.weight", "0.bias"]
        assert all(g.exact_zero and g.max_abs == 0.0 and g.max_rel == 0.0 for g in gradients)


class _RecordsItsBatch(torch.nn.Module):
    """A Linear with a one-value fp32 buffer that each forward sets to 2**-(5 * rows)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("record", torch.ones(()))

    def forward(self, x):
        self.record.fill_(2.0 ** (-5 * x.shape[0]))
        return self.linear(x)


def test_a_buffers_difference_is_exact_also_where_fp32_could_not_hold_it():
    report = compare_accumulation(_RecordsItsBatch(), regression_batches(1, 8, in_features=4, out_features=3)[0], 4)
    for dtype in ("float32", "float64"):
        (record,) = report[dtype].buffers
        assert (record.whole, record.accumulated) == (2.0**-40, 2.0**-10)  # 8 rows whole, 2 in the last micro-batch
        assert record.max_abs == 2.0**-10 - 2.0**-40  # 31 significant bits: in fp32 it would round to 2**-10


def test_compare_leaves_the_model_untouched():
    model = tiny_mlp("batch")
    before = copy.deepcopy(model.state_dict())
    compare_accumulation(model, regression_batches(1, batch_size=8)[0], 2)
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert all(p.grad is None for p in model.parameters())


def test_report_renders_as_text_and_html():
    report = compare_accumulation(tiny_mlp("batch"), regression_batches(1, batch_size=8)[0], 2)
    assert "float64" in str(report) and "1 / 2" in str(report)
    assert report._repr_html_().startswith("<table>")


def test_results_show_as_short_tables_in_plain_text_views():
    """What a saved notebook, nbval or a terminal shows: the table, not a wall of dataclass fields."""
    from IPython.core.formatters import PlainTextFormatter

    batch = regression_batches(1, batch_size=8)[0]
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = [
        compare_accumulation(tiny_mlp("batch"), batch, 2),
        compare_batchnorm_remedies(tiny_mlp("batch"), batch, 2),
        reference_loop(model, optimizer, regression_batches(3), SampleLoss(), 2),
    ]
    for result in results:
        shown = PlainTextFormatter()(result)
        assert shown == str(result) and len(shown.splitlines()) <= 8 and "=" not in shown.splitlines()[0]
        assert repr(result).startswith(type(result).__name__ + "(")  # repr() stays the full dataclass repr


# ---------------------------------------------------------------------------------------------------
# Bad input: clear errors, never a silent NaN
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, error, message",
    [
        (0, ValueError, ">= 1"),
        (-2, ValueError, ">= 1"),
        (17, ValueError, "K must be <= the batch size"),
        (2.0, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
    ],
)
def test_bad_k_is_a_clear_error(k, error, message):
    with pytest.raises(error, match=message):
        compare_accumulation(tiny_mlp("layer"), regression_batches(1, batch_size=16)[0], k)


def test_k_equal_to_the_batch_size_is_fine():
    report = compare_accumulation(tiny_mlp("layer"), regression_batches(1, batch_size=5)[0], 5)
    assert report.micro_batch_rows == [1] * 5 and report["float64"].max_rel_grad < 1e-12


def test_a_batch_without_valid_tokens_is_an_error():
    batch = token_batch()
    batch["labels"][:] = -100
    with pytest.raises(ValueError, match="no valid items"):
        compare_accumulation(TinyTokenLM(), batch, 2)


def test_an_empty_micro_batch_is_exact_globally_and_an_error_naively():
    batch = token_batch(rows=6)
    batch["labels"][2:4] = -100  # micro-batch 1 of 3 has no valid token
    report = compare_accumulation(TinyTokenLM(), batch, 3)
    assert report.micro_batch_items[1] == 0
    assert math.isfinite(report["float32"].max_rel_grad) and report["float64"].max_rel_grad < 1e-12
    with pytest.raises(ValueError, match="micro-batch 1 has no valid items"):
        compare_accumulation(TinyTokenLM(), batch, 3, normalization="naive")


def test_dropout_is_refused_and_unknown_normalisation_too():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match="Dropout"):
        compare_accumulation(model, regression_batches(1, batch_size=4)[0], 2)
    with pytest.raises(ValueError, match="unknown normalization"):
        compare_accumulation(tiny_mlp(), regression_batches(1, batch_size=4)[0], 2, normalization="mean")


# ---------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------


def test_split_and_concat_round_trip():
    batch = token_batch(rows=7)
    parts = split_batch(batch, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2, 2]
    whole = concat_batches(parts)
    assert all(torch.equal(whole[key], batch[key]) for key in batch)
    x, y = regression_batches(1, batch_size=5)[0]
    a, b = split_batch((x, y), 2)
    assert torch.equal(concat_batches([a, b])[0], x)


def test_concat_pads_micro_batches_of_different_lengths():
    short = collate_padded([{"input_ids": torch.tensor([5, 6])}])
    long = collate_padded([{"input_ids": torch.tensor([1, 2, 3, 4])}])
    whole = concat_batches([short, long])
    assert whole["input_ids"].shape == (2, 4)
    assert whole["labels"][0].tolist() == [5, 6, -100, -100] and whole["attention_mask"][0].tolist() == [1, 1, 0, 0]
    assert TokenLoss().count(whole) == TokenLoss().count(short) + TokenLoss().count(long) == 1 + 3


def test_windows_group_micro_batches_with_a_short_last_one():
    batches = regression_batches(10, batch_size=2)
    assert [len(w) for w in windows(batches, 4)] == [4, 4, 2]
    assert [w[0] for w in windows(batches, 4)] == [batches[0], batches[4], batches[8]]
    assert [len(w) for w in windows(batches[:3], 8)] == [3]
    assert list(windows([], 4)) == []
    with pytest.raises(ValueError):
        list(windows(batches[:3], 0))
    with pytest.raises(ValueError, match="batches must be a list"):  # a micro-batch is a batch, never a number
        list(windows(range(3), 2))


# ---------------------------------------------------------------------------------------------------
# BatchNorm remedies
# ---------------------------------------------------------------------------------------------------


def test_remedies_measured_side_by_side():
    k = 4
    report = compare_batchnorm_remedies(tiny_mlp("batch"), regression_batches(1, batch_size=16)[0], k)
    plain = report.row("BatchNorm (no remedy)")
    assert plain.max_rel_grad > 0.1 and plain.max_running_stat_diff > 1e-3 and plain.batches_tracked == f"1 / {k}"
    for name in ("GroupNorm instead", "LayerNorm instead (GroupNorm(1, C))"):
        row = report.row(name)
        assert row.max_rel_grad < 1e-12 and row.batches_tracked == "none"
    ghost = report.row("ghost batches of the micro-batch size")
    assert ghost.max_rel_grad < 1e-12 and ghost.max_running_stat_diff < 1e-12 and ghost.batches_tracked == f"{k} / {k}"
    frozen = report.row("frozen statistics")
    assert frozen.max_rel_grad < 1e-12 and frozen.max_running_stat_diff == 0.0
    assert all(row.fixes and row.does_not_fix for row in report.rows)
    assert plain.vs_batchnorm_whole == 0.0
    assert all(row.vs_batchnorm_whole > 1e-3 for row in report.rows[1:]), "no remedy is large-batch BatchNorm"
    assert "ghost" in str(report) and report._repr_html_().startswith("<table>")


def test_remedies_need_batchnorm_and_an_even_split():
    with pytest.raises(ValueError, match="no BatchNorm"):
        compare_batchnorm_remedies(tiny_mlp("layer"), regression_batches(1, batch_size=8)[0], 2)
    with pytest.raises(ValueError, match="split evenly"):
        compare_batchnorm_remedies(tiny_mlp("batch"), regression_batches(1, batch_size=10)[0], 4)


def test_ghost_batchnorm_is_plain_batchnorm_on_one_ghost_batch_and_in_eval():
    torch.manual_seed(0)
    plain, x = tiny_mlp("batch"), torch.randn(8, 8)
    ghost = ghost_batchnorm(plain, 8)
    assert torch.allclose(plain(x), ghost(x))
    assert not torch.allclose(plain(x), ghost_batchnorm(plain, 4)(x))
    fresh = tiny_mlp("batch").eval()
    assert torch.allclose(fresh(x), ghost_batchnorm(fresh, 4).eval()(x))


def test_frozen_statistics_stay_frozen_under_train_and_are_calibrated():
    torch.manual_seed(0)
    x = torch.randn(32, 8) * 3 + 1
    frozen = freeze_batchnorm_stats(tiny_mlp("batch"), calibration_batches=[(x, None)])
    frozen.train()
    bn = frozen[1]
    assert not bn.training and frozen.training
    with torch.no_grad():
        expected = frozen[0](x).mean(0)
    assert torch.allclose(bn.running_mean, expected, atol=1e-5)
    before = bn.running_mean.clone()
    frozen(torch.randn(4, 8))
    assert torch.equal(bn.running_mean, before)


def test_replace_batchnorm_keeps_the_affine_weights():
    model = tiny_mlp("batch")
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    group = replace_batchnorm(model, "group")
    layer = replace_batchnorm(model, "layer")
    assert isinstance(group[1], torch.nn.GroupNorm) and group[1].num_groups > 1
    assert isinstance(layer[1], torch.nn.GroupNorm) and layer[1].num_groups == 1
    assert torch.equal(group[1].weight, model[1].weight)
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in group.modules())
    with pytest.raises(ValueError):
        replace_batchnorm(model, "instance")


def test_replace_batchnorm_reaches_a_batchnorm_nested_in_a_submodule():
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model = torch.nn.Sequential(inner, torch.nn.ReLU())
    replaced = replace_batchnorm(model, "layer")
    assert [name for name, _ in replaced.named_children()] == ["0", "1"]
    assert isinstance(replaced[0][1], torch.nn.GroupNorm) and replaced[0][1].num_groups == 1
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in replaced.modules())
    assert isinstance(model[0][1], torch.nn.BatchNorm1d)  # a copy: the model given is left as it was


# ---------------------------------------------------------------------------------------------------
# The reference loop: each behaviour, and the check that catches each mistake
# ---------------------------------------------------------------------------------------------------


def test_reference_loop_passes_the_training_loop_check(capsys):
    checks.check_training_loop(reference_loop)
    assert "Correct" in capsys.readouterr().out


# The hint each mistake must produce: the check recognises the mistake, not just "something is wrong".
HINTS = {
    "mean_per_micro_batch": "the mean of per-micro-batch means is wrong",
    "divide_by_configured_k": "the short final window is wrong",
    "no_step_after_short_window": "needs its step too",
    "scheduler_per_micro_batch": "the scheduler stepped 8 times for 2 optimizer steps",
    "clip_before_last_micro_batch": "clipping is in the wrong place",
    "clip_before_unscale": "scaler.unscale_(optimizer)",
    "zero_grad_to_zero": "tensors of zeros",
    "optimizer_step_per_micro_batch": "stepping after every micro-batch is training with small batches",
    "never_zero_grad": "the gradients were not reset",
    "sync_every_micro_batch": "no micro-batch ran inside model.no_sync()",
    "never_sync": "the last one too",
}


def test_every_mistake_but_the_per_rank_count_has_a_hint():
    assert set(HINTS) == set(MISTAKES) - {"count_per_rank"}  # that one needs two processes: see the DDP tests


@pytest.mark.parametrize("mistake", sorted(HINTS))
def test_the_check_catches_each_mistake(mistake):
    with pytest.raises(AssertionError, match=re.escape(HINTS[mistake])):
        checks.check_training_loop(functools.partial(train_with_mistake, mistake, progress=False))


def test_each_numeric_mistake_moves_the_weights_and_the_reference_does_not():
    results = dict(demonstrate_mistakes())
    assert results.pop("none") < 1e-5
    assert results.pop("zero_grad_to_zero") < 1e-5  # same numbers: its cost is memory, caught by the probe
    assert set(results) == set(HINTS) - {"zero_grad_to_zero"} - DDP_ONLY
    assert all(diff > 1e-2 for diff in results.values()), results


# check_training_loop (the check lesson 2 runs on its accumulation_loop) against a loop with five planted
# mistakes. This builds the loop with any subset of them, to prove that the check names a mistake that is
# present, whichever remain.
PLANTED_HINTS = {
    "token_normalisation": ("normalise it by its own item count", "token count of the whole window"),
    "short_last_window": ("needs its step too",),
    "scheduler": ("the scheduler stepped",),
    "unscale_before_clip": ("scaler.unscale_(optimizer)",),
    "no_sync": ("the last one too",),
}


def planted_loop(planted):
    def train(model, optimizer, batches, loss, accumulation_steps, scheduler=None, max_grad_norm=None, scaler=None):
        k = accumulation_steps
        if k <= 0:
            raise ValueError("accumulation_steps must be >= 1")
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batches), k):
            window = batches[start : start + k]
            items = sum(loss.count(mb) for mb in window)
            for i, mb in enumerate(window):
                quiet = hasattr(model, "no_sync") and ("no_sync" in planted or i < len(window) - 1)
                with model.no_sync() if quiet else contextlib.nullcontext():
                    divisor = loss.count(mb) * k if "token_normalisation" in planted else items
                    part = loss.sum(model, mb) / divisor
                    (scaler.scale(part) if scaler is not None else part).backward()
                if "scheduler" in planted and scheduler is not None:
                    scheduler.step()
            if "short_last_window" in planted and len(window) < k:
                continue
            if scaler is not None and "unscale_before_clip" not in planted:
                scaler.unscale_(optimizer)
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler is not None and "scheduler" not in planted:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def named_mistake(hint):
    return [m for m, phrases in PLANTED_HINTS.items() if any(p in hint for p in phrases)]


@pytest.mark.parametrize("mistake", sorted(PLANTED_HINTS))
def test_each_planted_mistake_alone_is_named(mistake):
    hint = checks.training_loop_problem(planted_loop({mistake}))
    assert hint is not None and named_mistake(hint) == [mistake], hint


def test_fixing_the_named_mistake_each_time_ends_with_a_right_loop(capsys):
    remaining = set(PLANTED_HINTS)
    while remaining:
        hint = checks.training_loop_problem(planted_loop(remaining))
        named = named_mistake(hint or "")
        assert len(named) == 1 and named[0] in remaining, (remaining, hint)
        remaining -= set(named)
    assert checks.training_loop_problem(planted_loop(set())) is None
    checks.check_training_loop(planted_loop(set()))
    assert "Correct" in capsys.readouterr().out


def test_loop_result_counts_windows_steps_items_and_lrs():
    batches = padded_token_batches(10, batch_size=2, seed=3)
    model = TinyTokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    result = reference_loop(model, optimizer, batches, TokenLoss(), 4, scheduler=scheduler, max_grad_norm=1.0)
    assert (result.windows, result.steps, result.micro_batches, result.skipped_steps) == (3, 3, 10, 0)
    counts = [TokenLoss().count(b) for b in batches]
    assert result.items == [sum(counts[:4]), sum(counts[4:8]), sum(counts[8:])]
    assert result.lrs == [0.1, 0.05, 0.025] and scheduler.last_epoch == 3
    assert len(result.grad_norms) == 3 and all(math.isfinite(x) for x in result.losses)
    assert all(p.grad is None for p in model.parameters()), "gradients are set to None after the last step"


def test_loop_rejects_bad_arguments():
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = regression_batches(2)
    for k in (0, -1):
        with pytest.raises(ValueError, match=">= 1"):
            reference_loop(model, optimizer, batches, SampleLoss(), k)
    with pytest.raises(ValueError, match="unknown mistake .typo."):
        train_with_mistake("typo", model, optimizer, batches, SampleLoss(), 2)
    with pytest.raises(ValueError, match="max_grad_norm"):
        reference_loop(model, optimizer, batches, SampleLoss(), 2, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="empty_window"):
        reference_loop(model, optimizer, batches, SampleLoss(), 2, empty_window="ignore")


def test_k_larger_than_the_data_is_one_short_window():
    batches = regression_batches(3)
    model, truth = tiny_mlp(), tiny_mlp()
    opt, t_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, truth))
    result = reference_loop(model, opt, batches, SampleLoss(), 8)
    train_whole_windows(truth, t_opt, batches, SampleLoss(), 8)
    assert (result.windows, result.steps) == (1, 1) and max_weight_difference(model, truth) < 1e-6


def test_a_window_without_valid_tokens_is_an_error_or_skipped_never_nan():
    batches = padded_token_batches(6, batch_size=2, seed=4)
    for mb in batches[2:4]:
        mb["labels"][:] = -100  # window 2 of 3 (K=2) has no valid token
    model = TinyTokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="window 2 has no valid item"):
        reference_loop(model, optimizer, batches, TokenLoss(), 2)
    model = TinyTokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    result = reference_loop(model, optimizer, batches, TokenLoss(), 2, scheduler=scheduler, empty_window="skip")
    assert (result.windows, result.steps, result.empty_windows) == (3, 2, 1)
    assert scheduler.last_epoch == 2 and len(result.losses) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_step_skipped_by_gradscaler_does_not_step_the_scheduler():
    batches = regression_batches(4)
    model = tiny_mlp()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))  # every scaled gradient is inf or NaN
    result = reference_loop(model, optimizer, batches, SampleLoss(), 2, scheduler=scheduler, scaler=scaler)
    assert (result.windows, result.steps, result.skipped_steps) == (2, 0, 2)
    assert scheduler.last_epoch == 0, "a skipped optimizer step must not advance the schedule"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gradscaler_with_a_power_of_two_scale_changes_nothing():
    batches = padded_token_batches(6, batch_size=2, seed=8)
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        model = TinyTokenLM()
        reference_loop(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            batches,
            TokenLoss(),
            3,
            max_grad_norm=0.1,
            scaler=scaler,
        )
        runs.append(model)
    assert max_weight_difference(*runs) < 1e-6


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fp16_autocast_with_gradscaler_follows_fp32(device):
    batches = [{k: v.to(device) for k, v in b.items()} for b in padded_token_batches(8, batch_size=2, seed=9)]
    runs = []
    for autocast in (None, torch.float16):
        model = TinyTokenLM().to(device)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12) if autocast else None
        result = reference_loop(
            model,
            torch.optim.SGD(model.parameters(), lr=0.2),
            batches,
            TokenLoss(),
            4,
            max_grad_norm=0.5,
            scaler=scaler,
            autocast_dtype=autocast,
        )
        assert result.steps == 2 and all(math.isfinite(x) for x in result.losses)
        runs.append(model)
    assert 0 < max_weight_difference(*runs) < 2e-2


def test_progress_bar_shows_optimizer_steps_and_can_be_silenced(capsys):
    batches = regression_batches(6)
    model = tiny_mlp()
    train_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, SampleLoss(), 2)
    shown = capsys.readouterr().err
    assert "optimizer steps" in shown and "3/3" in shown and "loss=" in shown
    train_with_accumulation(
        model, torch.optim.SGD(model.parameters(), lr=0.1), batches, SampleLoss(), 2, progress=False
    )
    assert capsys.readouterr().err == ""


def test_progress_bar_works_without_a_length():
    model = tiny_mlp()
    result = train_with_accumulation(
        model, torch.optim.SGD(model.parameters(), lr=0.1), iter(regression_batches(5)), SampleLoss(), 2, progress=False
    )
    assert result.steps == 3


# ---------------------------------------------------------------------------------------------------
# Exercise 2.1: the check of accumulate_gradients catches each classic bug
# ---------------------------------------------------------------------------------------------------


def accumulate_right(model, micro_batches, loss):
    total = sum(loss.count(mb) for mb in micro_batches)
    if total == 0:
        raise ValueError("no valid item in the window")
    value = 0.0
    for mb in micro_batches:
        part = loss.sum(model, mb) / total
        part.backward()
        value += part.item()
    return value


def accumulate_naive_mean(model, micro_batches, loss):
    value = 0.0
    for mb in micro_batches:
        part = loss.sum(model, mb) / max(loss.count(mb), 1) / len(micro_batches)
        part.backward()
        value += part.item()
    if sum(loss.count(mb) for mb in micro_batches) == 0:
        raise ValueError("empty")
    return value


def accumulate_with_one_backward(model, micro_batches, loss):
    total = sum(loss.count(mb) for mb in micro_batches)
    if total == 0:
        raise ValueError("empty")
    value = sum(loss.sum(model, mb) for mb in micro_batches) / total
    value.backward()
    return value.item()


def accumulate_reweighted_mean(model, micro_batches, loss):
    """Right on paper (mean * count / total), but the mean of an empty micro-batch is NaN."""
    total = sum(loss.count(mb) for mb in micro_batches)
    if total == 0:
        raise ValueError("empty")
    value = 0.0
    for mb in micro_batches:
        n = loss.count(mb)
        part = loss.sum(model, mb) / torch.tensor(float(n)) * n / total
        part.backward()
        value += part.item()
    return value


def accumulate_without_empty_check(model, micro_batches, loss):
    total = max(sum(loss.count(mb) for mb in micro_batches), 1)
    value = 0.0
    for mb in micro_batches:
        part = loss.sum(model, mb) / total
        part.backward()
        value += part.item()
    return value


def accumulate_returning_nothing(model, micro_batches, loss):
    accumulate_right(model, micro_batches, loss)


def test_the_exercise_check_accepts_the_right_answer(capsys):
    checks.check_accumulate_gradients(accumulate_right)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (accumulate_naive_mean, "you averaged the per-micro-batch means"),
        (accumulate_with_one_backward, "backward ran 1 time"),
        (accumulate_reweighted_mean, "the returned loss is nan"),
        (accumulate_without_empty_check, "Raise ValueError"),
        (accumulate_returning_nothing, "return the window's loss"),
    ],
)
def test_the_exercise_check_catches_each_classic_bug(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        checks.check_accumulate_gradients(wrong)


# ---------------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def padded_batches(draw):
    rows = draw(st.integers(1, 8))
    length = draw(st.integers(2, 9))
    valid = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    k = draw(st.integers(1, rows))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32, (rows, length), generator=gen)
    mask = (torch.arange(length)[None, :] < torch.tensor(valid)[:, None]).long()
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}
    return batch, k


@PROPERTY
@given(data=padded_batches(), norm=st.sampled_from([None, "layer"]))
def test_property_token_accumulation_is_exact(data, norm):
    batch, k = data
    assume(TokenLoss().count(batch) > 0)
    report = compare_accumulation(TinyTokenLM(norm=norm), batch, k)
    assert report["float32"].max_rel_grad < 1e-5
    assert report["float64"].max_rel_grad < 1e-12


@PROPERTY
@given(
    rows=st.integers(1, 12),
    features=st.integers(1, 6),
    outputs=st.integers(1, 3),
    k=st.integers(1, 12),
    norm=st.sampled_from([None, "layer"]),
    seed=st.integers(0, 2**16),
)
def test_property_sample_accumulation_is_exact(rows, features, outputs, k, norm, seed):
    assume(k <= rows)
    gen = torch.Generator().manual_seed(seed)
    batch = (torch.randn(rows, features, generator=gen), torch.randn(rows, outputs, generator=gen))
    report = compare_accumulation(tiny_mlp(norm, in_features=features, out_features=outputs), batch, k)
    assert report["float32"].max_rel_grad < 1e-5
    assert report["float64"].max_rel_grad < 1e-12


@PROPERTY
@given(data=padded_batches())
def test_property_naive_mean_differs_exactly_when_token_counts_differ(data):
    batch, k = data
    counts = [TokenLoss().count(mb) for mb in split_batch(batch, k)]
    assume(min(counts) > 0)
    naive = compare_accumulation(TinyTokenLM(), batch, k, normalization="naive", dtypes=(torch.float64,))
    if len(set(counts)) > 1:
        assert naive["float64"].max_rel_grad > 1e-6, counts
    else:
        assert naive["float64"].max_rel_grad < 1e-12


def test_token_loss_matches_the_mean_cross_entropy():
    batch = token_batch()
    model = TinyTokenLM()
    logits = model(batch["input_ids"])
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 32), batch["labels"][:, 1:].reshape(-1))
    loss = TokenLoss()
    assert (loss.sum(model, batch) / loss.count(batch)).item() == pytest.approx(expected.item(), rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SampleLoss("cross_entropy").count((torch.zeros(3, 2), torch.zeros(3))) == 3


# ---------------------------------------------------------------------------------------------------
# Cost: same FLOPs, less memory (time is a benchmark's business, not a test's)
# ---------------------------------------------------------------------------------------------------


def test_cost_rows_same_flops_same_fixed_memory_peak_falls_with_the_micro_batch():
    rows = measure_accumulation_cost(
        effective_batch=8, micro_batches=(8, 2, 1), width=32, depth=2, seq_len=8, repeats=1
    )
    assert [r.k for r in rows] == [1, 4, 8]
    assert len({r.flops for r in rows}) == 1 and rows[0].flops > 0
    assert len({(r.parameters, r.gradients, r.optimizer_state, r.inputs) for r in rows}) == 1
    params = list(cost_model(32, 2).parameters())
    assert rows[0].optimizer_state == 2 * rows[0].parameters + 4 * len(params)
    # fp32 AdamW: 4 bytes of weight, 4 of gradient, 8 of moments a parameter, and a 4-byte step a tensor
    assert rows[0].fixed_bytes == 16 * sum(p.numel() for p in params) + 4 * len(params)
    assert all(a.peak_bytes > b.peak_bytes for a, b in zip(rows, rows[1:]))
    assert all(a.saved_per_micro_batch > b.saved_per_micro_batch for a, b in zip(rows, rows[1:]))
    assert all(r.ms_per_step > 0 for r in rows)
    assert rows[0].grad_add_bytes == 0 and rows[-1].grad_add_bytes == 3 * 7 * rows[-1].gradients
    table = format_cost_table(rows)
    assert "GFLOP/step" in table and ".grad adds" in table and len(table.splitlines()) == 4


def test_the_flop_counter_sees_matrix_products_only():
    """Why the FLOPs column is equal by construction: the additions into .grad count zero."""
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.randn(64, 64)
    with FlopCounterMode(display=False) as elementwise:
        a.add_(a)
        torch.tanh(a + a)
    with FlopCounterMode(display=False) as matmul:
        a @ a
    assert elementwise.get_total_flops() == 0 and matmul.get_total_flops() == 2 * 64**3
    with pytest.raises(ValueError, match="does not divide"):
        measure_accumulation_cost(effective_batch=8, micro_batches=(3,), width=8, depth=1, seq_len=2)


def test_benchmark_script_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    import importlib.util

    import matplotlib

    matplotlib.use("Agg")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "accumulation_cost.py"
    spec = importlib.util.spec_from_file_location("accumulation_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    plot = tmp_path / "cost.png"
    assert (
        script.main(
            [
                "--effective-batch",
                "4",
                "--micro-batches",
                "4",
                "1",
                "--width",
                "16",
                "--depth",
                "1",
                "--seq-len",
                "4",
                "--repeats",
                "1",
                "--device",
                "cpu",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "GFLOP/step" in out and plot.stat().st_size > 0


# Exercise 2.2: the end of a window under GradScaler. Each mistake alone is the one property named (skipping
# scaler.step or scaler.update is already torch's own RuntimeError at the next window).
def finish_window(model, optimizer, scheduler, scaler, max_grad_norm, mistake=None):
    if scaler is not None and mistake != "clip_before_unscale":
        scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler is None:
        optimizer.step()
        took = True
    else:
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        took = scaler.get_scale() >= before
    if scheduler is not None and (took or mistake == "scheduler_on_skipped_step"):
        scheduler.step()
    optimizer.zero_grad(set_to_none=mistake != "grads_kept")
    return True if mistake == "always_true" else took


FINISH_WINDOW_HINTS = {
    None: None,
    "clip_before_unscale": "clip after scaler.unscale_(optimizer)",
    "scheduler_on_skipped_step": "the learning rate must not move on",
    "grads_kept": "optimizer.zero_grad(set_to_none=True)",
    "always_true": "return True when the optimizer stepped, False when GradScaler skipped the step",
}


@pytest.mark.parametrize("mistake", FINISH_WINDOW_HINTS)
def test_check_finish_window_names_the_one_mistake_left(mistake):
    answer = functools.partial(finish_window, mistake=mistake)
    if mistake is None:
        checks.check_finish_window(answer)
        return
    with pytest.raises(checks.CheckFailed, match=re.escape(FINISH_WINDOW_HINTS[mistake])):
        checks.check_finish_window(answer)


# ---------------------------------------------------------------------------------------------------
# Boundaries the generated mutants found (benchmarks/mutation_score.py)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "norm, kind",
    [(None, torch.nn.Identity), ("none", torch.nn.Identity), ("layer", torch.nn.LayerNorm)]
    + [("batch", torch.nn.BatchNorm1d), ("group", torch.nn.GroupNorm)],
)
def test_tiny_mlp_puts_the_norm_it_is_asked_for_after_each_hidden_linear(norm, kind):
    model = tiny_mlp(norm=norm, depth=2)
    assert [type(model[i]) for i in (1, 4)] == [kind, kind]


def test_a_gradient_that_is_zero_in_both_runs_differs_by_nothing_not_by_infinity():
    model = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)  # zero output, zero targets: every gradient is exactly 0
    report = compare_accumulation(model, (torch.randn(4, 3), torch.zeros(4, 2)), k=2)
    assert report["float32"].max_rel_grad == 0.0 and report["float32"].max_abs_grad == 0.0


def test_weights_are_compared_in_float64_so_a_difference_fp32_rounds_away_is_seen():
    a, b = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    a.weight.data.fill_(2.0**24 + 2)  # both exact in fp32; their difference, 2**24 + 3, is not
    b.weight.data.fill_(-1.0)
    assert max_weight_difference(a, b) == 2.0**24 + 3
