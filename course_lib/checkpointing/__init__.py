"""Gradient checkpointing (lesson 3): plans, their cost model, the optimal plan, applying a plan
exactly, selective policies, measuring, and the models the lesson measures.

One module per job: `plans` (plans as segments, named plans, the cost model), `optimal` (the optimal
plan over all plans, pure Python), `apply` (applying a plan to a model, exact or refused),
`selective` (op-level policies), `profile` (what each layer stores, measured), `measuring` (a plan's
measured peak, time and recompute), `gradients` (the LoRA + reentrant trap), `demo_models`.
"""

from course_lib.checkpointing.apply import (
    AppliedPlan,
    apply_plan,
    checkpointed_forward,
    hf_checkpointing,
    hf_has_every_n_layers,
)
from course_lib.checkpointing.demo_models import (
    ARCHITECTURES,
    PointwiseBlock,
    ResidualMLP,
    mlp_stack,
    tiny_decoder,
    uneven_stack,
)
from course_lib.checkpointing.gradients import assert_gradients_flow
from course_lib.checkpointing.measuring import (
    PlanMeasurement,
    default_plans,
    format_tradeoff,
    measure_plan,
    measure_recompute,
    measure_tradeoff,
    time_plans,
)
from course_lib.checkpointing.optimal import all_plans, min_feasible_peak, optimal_plan, plan_frontier
from course_lib.checkpointing.plans import (
    PLAN_NAMES,
    Plan,
    PlanCost,
    StackModel,
    named_plan,
    plan_cost,
    segments_plan,
    validate_plan,
)
from course_lib.checkpointing.profile import StackProfile, flop_counter, profile_stack
from course_lib.checkpointing.selective import (
    ATTENTION_OPS,
    LINEAR_OPS,
    MATMUL_OPS,
    POLICIES,
    context_fn_for,
    korthikanti_policy,
    policy_name,
    save_everything_policy,
    save_matmuls_policy,
)
from course_lib.layers import find_layer_stack  # infrastructure: lesson 3 teaches it, every floor uses it

__all__ = [
    "AppliedPlan",
    "apply_plan",
    "checkpointed_forward",
    "find_layer_stack",
    "hf_checkpointing",
    "hf_has_every_n_layers",
    "ARCHITECTURES",
    "PointwiseBlock",
    "ResidualMLP",
    "mlp_stack",
    "tiny_decoder",
    "uneven_stack",
    "assert_gradients_flow",
    "PlanMeasurement",
    "default_plans",
    "format_tradeoff",
    "measure_plan",
    "measure_recompute",
    "measure_tradeoff",
    "time_plans",
    "all_plans",
    "min_feasible_peak",
    "optimal_plan",
    "plan_frontier",
    "PLAN_NAMES",
    "Plan",
    "PlanCost",
    "StackModel",
    "named_plan",
    "plan_cost",
    "segments_plan",
    "validate_plan",
    "StackProfile",
    "flop_counter",
    "profile_stack",
    "ATTENTION_OPS",
    "LINEAR_OPS",
    "MATMUL_OPS",
    "POLICIES",
    "context_fn_for",
    "korthikanti_policy",
    "policy_name",
    "save_everything_policy",
    "save_matmuls_policy",
]
