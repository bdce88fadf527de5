"""The test tiers. ``tests/conftest.py`` gives every test the marker of the first rule below whose
pattern matches its test id (``tests/<path>.py::<name>[<params>]``, shell-style ``fnmatch``), and
``unit`` when none does; so a test's tier follows from its path and no test body names it.

``make test-fast`` is ``pytest -m unit``; ``make test`` runs every tier. The contributor guide
(docs/guides/contributing.md) says which tier to run when and holds the durations table that
``python tools/test_durations.py`` regenerates.
"""

from __future__ import annotations

import fnmatch

# The tiers, in the order of the contributor guide: name -> what it holds.
TIERS = {
    "unit": "identities, invariants, plumbing and error messages: seconds each (make test-fast)",
    "slow": "integration runs: experiments end to end, CLI runs, resume, long fits",
    "notebooks": "the colabs executed in smoke mode and the site's executed copies",
    "docs": "the README's and the site's examples and the Sphinx build",
    "peers": "checks against PyTorch PEFT, transformers, PyKEEN and the other peers",
    "multiprocess": "several processes or eight fake devices in subprocesses",
}

# (pattern over the test id, tier); the first match wins.
RULES: tuple[tuple[str, str], ...] = (
    ("tests/test_notebooks.py::*", "notebooks"),
    ("tests/test_docs.py::*", "docs"),
    # several processes, or fake devices that need a process of their own
    ("tests/experiments/test_multiprocess.py::*", "multiprocess"),
    ("tests/experiments/test_devices.py::*", "multiprocess"),
    ("tests/adapters/test_sharding.py::*", "multiprocess"),
    ("tests/models/test_decoder_sharding.py::*", "multiprocess"),
    # the peers (the `peers` extra)
    ("tests/adapters/test_peft.py::test_pytorch_peft_*", "peers"),
    ("tests/adapters/test_peft_edge_cases.py::*", "peers"),
    ("tests/adapters/test_peft_minilm.py::*", "peers"),
    ("tests/adapters/test_peft_parity.py::*", "peers"),
    ("tests/analysis/test_pruning_peers.py::*", "peers"),
    ("tests/changepoint/test_changepoint.py::test_ruptures_*", "peers"),
    ("tests/data/test_text.py::test_transformers_*", "peers"),
    ("tests/data/test_text.py::test_assistant_mask_equals_transformers_*", "peers"),
    ("tests/merging/test_peft_agreement.py::*", "peers"),
    ("tests/models/test_decoder_hf.py::*", "peers"),
    ("tests/models/test_hf_vit.py::*", "peers"),
    ("tests/models/test_readme_decoder.py::*", "peers"),
    ("tests/tuning/test_bo.py::test_random_and_tpe_searches_follow_the_table", "peers"),
    ("tests/tuning/test_lasso.py::test_*_cvxpy_*", "peers"),
    ("tests/tuning/test_lasso.py::test_proxes_equal_their_definition", "peers"),
    ("tests/tuning/test_lasso_tuners.py::test_tpe_peer_*", "peers"),
    # integration runs (experiments end to end, CLI runs, resume) and tests that take more than
    # about five seconds (the durations table of docs/guides/contributing.md), by folder
    ("tests/test_wheel.py::*", "slow"),
    (
        "tests/adapters/test_adapt.py::test_convolutions_and_lookups_are_factorised_with_merged_values_and_gradients",
        "slow",
    ),
    ("tests/adapters/test_adapt.py::test_linen_scan_and_remat", "slow"),
    ("tests/adapters/test_adapt.py::test_plain_function_scan_remat_transpose", "slow"),
    ("tests/adapters/test_adapt.py::test_factorised_equals_merged_and_grads_match*", "slow"),
    ("tests/adapters/test_adapt.py::test_dropout_needs_key_and_is_inverted", "slow"),
    ("tests/adapters/test_adapt.py::test_training_step_has_no_weight_shaped_dot", "slow"),
    (
        "tests/adapters/test_dora.py::test_forward_transposed_and_merge_match_the_float64_reference",
        "slow",
    ),
    ("tests/adapters/test_dora.py::test_stacked_kernels_under_scan_and_remat", "slow"),
    (
        "tests/adapters/test_dora.py::test_gradients_treat_the_norm_as_a_constant_as_peft_does",
        "slow",
    ),
    ("tests/adapters/test_finetune.py::*", "slow"),
    ("tests/adapters/test_frameft.py::test_frameft_through_adapt_merge_and_unmerge", "slow"),
    ("tests/adapters/test_frameft.py::test_fft_path_never_materialises_an_n_by_m_array", "slow"),
    (
        "tests/adapters/test_fused_quant.py::test_low_precision_base_matches_its_float32_reference*",
        "slow",
    ),
    (
        "tests/adapters/test_fused_quant.py::test_fused_under_scan_remat_vmap_and_transposed_use",
        "slow",
    ),
    (
        "tests/adapters/test_kinds_baselines.py::test_spectral_zero_sigma_is_base_model_and_merges",
        "slow",
    ),
    ("tests/adapters/test_mixed.py::*", "slow"),
    ("tests/analysis/test_attention_dynamics.py::*", "slow"),
    ("tests/analysis/test_attention_dynamics_experiment.py::*", "slow"),
    ("tests/analysis/test_experiments.py::*", "slow"),
    ("tests/analysis/test_lora_value_drift_experiment.py::*", "slow"),
    ("tests/analysis/test_multitask.py::test_without_decoys_pooled_equals_oracle", "slow"),
    (
        "tests/analysis/test_multitask.py::test_pooled_is_erm_of_concatenated_data_and_oracle_finds_clean_threshold",
        "slow",
    ),
    ("tests/analysis/test_multitask.py::test_decoys_are_flat_in_their_zone", "slow"),
    ("tests/analysis/test_multitask.py::test_a_fixed_width_is_used_as_given_at_every_n", "slow"),
    ("tests/analysis/test_multitask_lower_bound.py::*", "slow"),
    ("tests/analysis/test_pruning.py::test_l1_and_taylor_definitions", "slow"),
    ("tests/analysis/test_pruning.py::test_exact_tpv_known_answer", "slow"),
    ("tests/analysis/test_pruning.py::test_prune_step_and_schedule", "slow"),
    ("tests/analysis/test_pruning_cnn.py::test_groups_of_the_cnn", "slow"),
    (
        "tests/analysis/test_pruning_cnn.py::test_jacobian_and_exact_tpv_channel_scores_match_their_definitions",
        "slow",
    ),
    ("tests/analysis/test_tpv.py::test_trace_heff_linear_closed_form_and_hutchinson", "slow"),
    (
        "tests/analysis/test_value_lora.py::test_embeddings_from_layer_match_the_full_encoder_and_zero_adapter_gives_zero_drift",
        "slow",
    ),
    ("tests/analysis/test_value_lora.py::test_gap_ratios_and_a_gap_crossing_update", "slow"),
    ("tests/changepoint/test_bench.py::*", "slow"),
    ("tests/changepoint/test_changepoint.py::*", "slow"),
    ("tests/changepoint/test_experiment.py::*", "slow"),
    ("tests/changepoint/test_simulate.py::*", "slow"),
    (
        "tests/continual/test_heads.py::test_aligned_head_keeps_old_classes_better_than_masked",
        "slow",
    ),
    ("tests/continual/test_heads.py::test_refit_head_equals_adam_through_the_frozen_model", "slow"),
    (
        "tests/continual/test_methods.py::test_every_method_runs_from_a_users_loop_and_its_state_is_a_pytree*",
        "slow",
    ),
    (
        "tests/continual/test_methods.py::test_features_through_the_head_are_predicts_logits*",
        "slow",
    ),
    (
        "tests/continual/test_methods.py::test_layer_inputs_of_a_stack_inside_lax_scan_and_remat",
        "slow",
    ),
    (
        "tests/continual/test_training.py::test_one_step_is_the_masked_objective_plus_penalty_through_tx",
        "slow",
    ),
    ("tests/data/test_text.py::test_packed_loss_is_the_sum_of_each_example_alone", "slow"),
    ("tests/experiments/test_accelerator_check.py::*", "slow"),
    ("tests/experiments/test_bench_adapter_step.py::test_last_line_is_the_json_headline", "slow"),
    ("tests/experiments/test_bench_adapter_step.py::test_one_curve_cell_table_and_plot", "slow"),
    ("tests/experiments/test_bench_llm_lora.py::*", "slow"),
    ("tests/experiments/test_bench_multi_adapter.py::*", "slow"),
    ("tests/experiments/test_casa.py::test_smoke_run_end_to_end", "slow"),
    ("tests/experiments/test_continual.py::*", "slow"),
    ("tests/experiments/test_continual_heads.py::*", "slow"),
    ("tests/experiments/test_image_benchmarks.py::test_*_smoke*", "slow"),
    (
        "tests/experiments/test_continual_search.py::test_search_choice_does_not_change_when_the_test_split_is_poisoned",
        "slow",
    ),
    ("tests/experiments/test_cost.py::test_smoke_run_metrics_hold_the_cost", "slow"),
    ("tests/experiments/test_extra_merge.py::*", "slow"),
    (
        "tests/experiments/test_faults.py::test_cli_nan_run_fails_in_one_line_and_a_failed_start_does_not_block_the_rerun",
        "slow",
    ),
    (
        "tests/experiments/test_faults.py::test_cli_recovers_from_a_truncated_checkpoint_in_one_line",
        "slow",
    ),
    (
        "tests/experiments/test_faults.py::test_cli_skip_nonfinite_config_trains_through_nan_steps",
        "slow",
    ),
    ("tests/experiments/test_faults.py::test_cli_finite_divergence_stops_with_max_loss", "slow"),
    ("tests/experiments/test_fp8_attention.py::*", "slow"),
    ("tests/experiments/test_fp8_minilm.py::*", "slow"),
    ("tests/experiments/test_gist.py::test_synthetic_smoke_run_selects_and_reports", "slow"),
    ("tests/experiments/test_kernel_score_bench.py::*", "slow"),
    ("tests/experiments/test_kge.py::*", "slow"),
    ("tests/experiments/test_llm_lora.py::*", "slow"),
    ("tests/experiments/test_llm_sft.py::test_smoke_run_*", "slow"),
    ("tests/experiments/test_llm_sft.py::test_the_adapter_loads_in_pytorch_peft_*", "slow"),
    ("tests/experiments/test_llm_sft.py::test_a_*", "slow"),
    ("tests/experiments/test_llm_sft.py::test_dora_and_qlora_by_config", "slow"),
    ("tests/experiments/test_llm_sft.py::test_paper_methods_by_config", "slow"),
    ("tests/experiments/test_llm_sft.py::test_initialisers_keep_or_move_the_base", "slow"),
    ("tests/experiments/test_llm_sft_methods.py::test_continual_over_files_*", "slow"),
    ("tests/experiments/test_llm_sft_methods.py::test_gist_*", "slow"),
    ("tests/experiments/test_llm_sft_methods.py::test_a_tfds_*", "slow"),
    ("tests/experiments/test_llm_sft_methods.py::test_fp8_*", "slow"),
    ("tests/experiments/test_lora_bo.py::*", "slow"),
    ("tests/experiments/test_lora_finetune.py::*", "slow"),
    (
        "tests/experiments/test_lora_finetune_base_dtype.py::test_int8_base_is_quantised_and_starts_near_the_pretrained_model",
        "slow",
    ),
    ("tests/experiments/test_lowering.py::*", "slow"),
    ("tests/experiments/test_multidim_tuning.py::*", "slow"),
    (
        "tests/experiments/test_options.py::test_run_without_options_builds_them_from_its_config",
        "slow",
    ),
    ("tests/experiments/test_peft_studies.py::*", "slow"),
    ("tests/experiments/test_resume.py::*", "slow"),
    ("tests/experiments/test_spr.py::test_smoke_run_writes_a_ci_table_and_resumes", "slow"),
    (
        "tests/experiments/test_subspace_diffusion.py::test_smoke_run_writes_outputs_and_resumes",
        "slow",
    ),
    (
        "tests/experiments/test_subspace_diffusion.py::test_the_resolve_config_runs_*",
        "slow",
    ),
    ("tests/experiments/test_tfft.py::*", "slow"),
    ("tests/experiments/test_train_cli.py::test_smoke_run_writes_every_output", "slow"),
    (
        "tests/experiments/test_train_cli.py::test_help_lists_configs_with_options_and_a_missing_config_lists_them",
        "slow",
    ),
    ("tests/experiments/test_train_cli.py::test_invalid_value_fails_before_computation", "slow"),
    (
        "tests/fp8/test_policies.py::test_geometry_state_machine_matches_per_layer_vmap_and_float64_svd",
        "slow",
    ),
    (
        "tests/generative/test_adjoint.py::test_adjoint_matching_moves_the_mean_to_the_tilted_optimum",
        "slow",
    ),
    (
        "tests/generative/test_adjoint.py::test_lean_adjoint_is_the_pathwise_gradient_along_the_base_trajectory",
        "slow",
    ),
    ("tests/generative/test_flows.py::test_train_flow_learns_the_resampled_law", "slow"),
    ("tests/generative/test_kernel_score.py::test_sampler_concentrates_on_the_subspaces", "slow"),
    (
        "tests/generative/test_kernel_score.py::test_exponential_integrator_is_exact_on_a_gaussian",
        "slow",
    ),
    (
        "tests/generative/test_kernel_score.py::test_tweedie_step_is_the_denoiser_at_t0_of_the_noisy_sample",
        "slow",
    ),
    (
        "tests/generative/test_kernel_score.py::test_preconditioned_denoiser_is_the_wiener_filter_at_zero_and_its_target_has_unit_variance",
        "slow",
    ),
    (
        "tests/generative/test_kernel_score.py::test_tweedie_output_is_embedding_invariant_and_the_noisy_sample_is_not",
        "slow",
    ),
    ("tests/kge/test_outputs.py::test_mos_layer_matches_reference_and_extra_params", "slow"),
    ("tests/kge/test_training.py::*", "slow"),
    ("tests/merging/test_casa.py::*", "slow"),
    (
        "tests/merging/test_mergekit.py::test_merge_della_on_stacked_lora_uses_one_mask_per_layer_and_is_seeded",
        "slow",
    ),
    (
        "tests/merging/test_task_vectors.py::test_merging_lora_products_equals_merging_dense_deltas",
        "slow",
    ),
    ("tests/models/test_bert_prefix.py::*", "slow"),
    ("tests/models/test_decoder.py::test_bfloat16_compute_close_to_float32", "slow"),
    ("tests/models/test_decoder.py::test_remat_policy_changes_nothing", "slow"),
    (
        "tests/models/test_decoder.py::test_packed_segments_give_the_logits_of_each_sequence_alone*",
        "slow",
    ),
    ("tests/models/test_decoder.py::test_cache_prefill_and_decode_equal_full_forward", "slow"),
    ("tests/models/test_decoder.py::test_sampler_temperature_and_eos", "slow"),
    ("tests/models/test_decoder_continual.py::*", "slow"),
    ("tests/models/test_decoder_fp8.py::*", "slow"),
    ("tests/models/test_decoder_lora.py::*", "slow"),
    ("tests/models/test_decoder_methods.py::*", "slow"),
    ("tests/models/test_fp8_transformer.py::test_geometry_readout_feeds_a_policy", "slow"),
    ("tests/models/test_minilm.py::test_dropout_active_only_when_not_deterministic", "slow"),
    (
        "tests/models/test_small_models.py::test_vit_scan_equals_unrolled_with_stacked_params",
        "slow",
    ),
    ("tests/models/test_small_models.py::test_char_gpt_shapes_and_causality*", "slow"),
    (
        "tests/prompts/test_prompts.py::test_disabled_prompts_and_probe_equal_the_frozen_model",
        "slow",
    ),
    (
        "tests/prompts/test_prompts.py::test_spr_at_init_is_its_map_base_and_each_module_acts_as_specified",
        "slow",
    ),
    (
        "tests/prompts/test_prompts.py::test_gradients_reach_prompts_and_head_never_the_backbone*",
        "slow",
    ),
    (
        "tests/prompts/test_prompts.py::test_dcp_and_spr_prompts_depend_on_the_input_and_map_msp_do_not",
        "slow",
    ),
    (
        "tests/selection/test_diagnostics.py::test_lora_vs_full_uses_equal_sizes_and_the_named_coordinates",
        "slow",
    ),
    ("tests/selection/test_selection.py::test_pipelines_match_their_pieces", "slow"),
    (
        "tests/selection/test_selection.py::test_jl_projection_blockwise_equals_matrix_and_preserves_inner_products",
        "slow",
    ),
    (
        "tests/selection/test_selection.py::test_per_example_grads_equal_a_loop_of_single_grads_float64",
        "slow",
    ),
    ("tests/selection/test_selection_bench.py::*", "slow"),
    (
        "tests/tuning/test_bo.py::test_residual_token_starts_off_and_is_fitted_by_the_marginal_likelihood",
        "slow",
    ),
    (
        "tests/tuning/test_bo.py::test_bo_beats_random_search_on_a_discrete_function_in_expectation_over_seeds",
        "slow",
    ),
    (
        "tests/tuning/test_lasso_tuners.py::test_instance_losses_are_validation_losses_and_padding_changes_nothing",
        "slow",
    ),
)


def tier_of(test_id: str) -> str:
    """The tier of a test, from its id (``tests/adapters/test_core.py::test_merge[lora]``)."""
    for pattern, tier in RULES:
        if fnmatch.fnmatchcase(test_id, pattern):
            return tier
    return "unit"
