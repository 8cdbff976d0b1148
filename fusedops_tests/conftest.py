import os
import re

import pytest
import torch

# The interpreter-plan tests run Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 before
# triton is first imported. On a machine with CUDA the tests run the real kernels instead, unless the
# caller sets TRITON_INTERPRET=1 explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    # CI draws more examples per property than a developer's edit-test loop wants; 30, not 50, since CI's stages
    # reached 86 of their 90 minutes on 2 cores (stop 54).
    max_examples=int(os.environ.get("FUSEDOPS_HYPOTHESIS_EXAMPLES", "30" if os.environ.get("CI") == "true" else "20")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    # CI (CI=true) replays one fixed sequence of examples so a landing never hinges on a lucky draw;
    # local runs keep drawing new ones, which is where new failures are found.
    derandomize=os.environ.get("CI") == "true",
)
settings.register_profile("fast", settings.get_profile("ci"), max_examples=5)
settings.load_profile("ci")


# The fast tier (`pytest -m fast`, CONTRIBUTING.md): every op's forward and gradients against float64 on every
# path (the reference, the CUDA and the Ascend plan in the interpreter), a small-budget kernel path, opcheck and a
# torch.compile round trip per op, and the plan-fit, dispatch, npu-registration and bench-harness checks: about
# 4 minutes on 2 cores. By file: test functions (all their parametrizations), or "name[id prefix" for some.
# The marker is given here, so tests in files other people own need no edit; test_fast_tier.py checks the names.
FAST_TIER = {
    "test_attn_res.py": ["test_matches_einsum", "test_matches_einsum_tiled_over_d", "test_opcheck[True-",
                         "test_compile_fullgraph_matches_eager", "test_cuda_plan_fits_model_rows_on_chip"],
    "test_block_attn_res.py": ["test_block_equals_single_query_softmax_over_all_sources",
                               "test_merge_fused_variants_equal_their_composition"],
    "test_embedding.py": ["test_matches_torch", "test_backward_every_run_length_up_to_29", "test_opcheck",
                          "test_compile_fullgraph_matches_eager", "test_plans_fit_targets"],
    "test_neighborhood_attention.py": ["test_matches_dense_oracle", "test_kernels_many_tiles_small_budget",
                                       "test_opcheck", "test_compile_fullgraph_matches_eager"],
    "test_dispatch.py": ["test_direct_path_matches_torch_ops_bitwise", "test_meta_tensors_give_shapes_and_dtypes"],
    "test_targets.py": ["test_attn_res_plans_fit", "test_embedding_plans_fit", "test_neighborhood_attention_plans_fit",
                        "test_interpret_mode"],
    "test_npu_registration.py": ["test_register_npu_kernels_after_rename"],
    "test_bench.py": ["test_measure_never_raises_and_fills_rates", "test_fwd_bwd_fns_compute_gradients",
                      "test_select_sizes_and_quick", "test_table_and_plot", "test_missing_baseline_is_one_row_per_op",
                      "test_missing_op_module_is_a_row_not_a_crash",
                      "test_alternated_rows_take_turns_and_report_medians",
                      "test_sizes_select_the_cases_of_the_device_that_runs",
                      "test_repository_alias_runs_the_packaged_bench"],
    "test_example_lm.py": ["test_loss_plot_without_matplotlib_says_it_was_skipped"],
    "test_fast_tier.py": ["test_every_fast_tier_entry_names_a_test"],
    "test_plans.py": ["test_resolver_prefers_the_specific_row", "test_tables_are_valid_and_name_their_runs",
                      "test_override_forces_nests_and_restores", "test_override_reaches_the_launched_kernels"],
}


def in_fast_tier(filename: str, name: str) -> bool:
    """Whether test `name` (a module-level test function with its parametrization id; "Class::test..." for a
    test in a class, never in the tier) of fusedops_tests/`filename` is in FAST_TIER."""
    return any(name == entry or name.startswith(entry if "[" in entry else entry + "[")
               for entry in FAST_TIER.get(filename, ()))


def pytest_configure(config):
    """The fast tier (`-m fast`) draws 5 examples per property, unless FUSEDOPS_HYPOTHESIS_EXAMPLES says
    otherwise; properties with their own @settings keep theirs."""
    markexpr = config.getoption("markexpr", "") or ""
    if re.search(r"(?<!not )\bfast\b", markexpr) and "FUSEDOPS_HYPOTHESIS_EXAMPLES" not in os.environ:
        settings.load_profile("fast")


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_fast_tier(item.path.name, item.nodeid.split("::", 1)[-1]):
            item.add_marker(pytest.mark.fast)
