"""Mutation testing of the modules that decide things, one module at a time, with mutmut 3.

    python scripts/mutate.py                 # every module in MODULES, then a score table
    python scripts/mutate.py ops/moonep/padding     # one module (a key of MODULES)

Why mutmut 3 and not cosmic-ray: mutmut forks each mutant from one warmed-up pytest process and runs
only the tests that reached the mutated function (it records that in a stats pass), so a mutant costs
a fraction of a second even though our tests import torch; cosmic-ray starts a fresh test command per
mutant (seconds of torch import each), which would not fit 2 cores and half an hour.

Each module runs in its own scratch directory ``build/mutate/<key>/`` holding copies of ``src/`` and
``tests/`` and a generated ``pyproject.toml`` whose ``[tool.mutmut]`` names that module and its fast
test files, so runs are independent and can be repeated alone.

Mutants are what the tests import: mutmut puts ``mutants/src`` first on ``sys.path`` of its own
process only; a subprocess (``python -c``, a vLLM environment) would load the editable install of
``src/``. So the run sets ``PYTHONPATH=<scratch>/mutants/src`` for every process it starts, and
before the run a canary, mutmut's "fail" mutant, must fail in a fresh interpreter of each
environment the module's tests use: a function of the module, imported there, has to raise mutmut's
forced failure and come from the scratch copy.

A mutant listed in EQUIVALENT (no observable change; the reason is written beside it) is left out of
the score; a mutant no selected test reaches counts as survived.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "build" / "mutate"

# key -> (module path under src/moonep_ep, fast test files, mutant name patterns or None for all,
#         a function of the module the canary calls with no arguments' worth of work).
# "functions" restricts the run to those functions' mutants: "func" for a module-level function,
# "Class.method" for a method.
MODULES: dict[str, dict] = {
    "ops/decode/padding": {
        "tests": ["tests/vllm/test_padding_decisions.py"],
        "canary": "group_padding",
    },
    "ops/moonep/padding": {
        "tests": ["tests/ops/test_padding.py", "tests/vllm/test_padding_decisions.py"],
        "canary": "real_entries",
    },
    "ops/decode/cost": {
        "tests": ["tests/ops/test_decode_cost.py", "tests/vllm/test_padding_decisions.py"],
        "canary": None,
    },
    "ops/moonep/planner": {   # every mutant reruns the property tests: 20 Hypothesis examples each, not 200
        # (test_push_planner: the push generation plans through the same build_plan)
        "tests": ["tests/ops/test_planner.py", "tests/ops/test_padding.py", "tests/ops/test_push_planner.py"],
        "max_examples": 20,
        "canary": "plan_dispatch",
    },
    "layout/formats": {   # the in-process tests (the slow ones spawn ranks, where mutmut's stats pass cannot see
        # the formats run, and take minutes of each clean and stats pass); 20 examples of the closed-form property
        "tests": ["tests/layout/test_formats.py", "tests/layout/test_quantized_store.py",
                  "tests/ops/test_quantized_experts.py"],
        "select": ["-m", "not slow"],
        "max_examples": 20,
        "canary": None,
    },
    "layout/plan": {   # the in-process tests only: the slow ones spawn 4 ranks per test (the page plan runs
        # there, where mutmut's stats pass cannot see it), 10 of 201 mutants fitted 600 s with them
        "tests": ["tests/layout/test_layout.py", "tests/layout/test_quantized_store.py",
                  "tests/layout/test_push_layout.py"],
        "select": ["-m", "not slow"],
        "canary": None,
    },
    "vllm/checkpoint/schemes": {
        "tests": ["tests/vllm/test_quantized_schemes.py", "tests/vllm/test_quant_config_formats.py",
                  "tests/vllm/test_quantized_refusal_texts.py"],
        "canary": None,
    },
    "vllm/store/loading": {   # the reload precheck only
        "tests": ["tests/vllm/test_quantized_schemes.py"],
        "functions": ["precheck_reload", "_checkpoint_problems", "_format_problems",
                      "_expected_checkpoint_tensors", "_expert_checkpoint_modules", "_expert_tensor_of",
                      "_torch_dtype_name"],
        "canary": None,
    },
    "memory/domain": {
        "tests": ["tests/memory/test_domain_vote.py"],
        "canary": None,
    },
    "memory/exchange": {   # the vote only
        "tests": ["tests/memory/test_domain_vote.py"],
        "functions": ["local_vote", "vote"],
        "canary": None,
    },
    "ops/experts/grouped_blocks": {
        "tests": ["tests/ops/test_grouped_blocks.py"],
        "canary": None,
    },
    "ops/experts/mxfp4_kernel": {   # the host side: launch parameters and the shape checks (the jitted kernel body
        # inside _kernel is Triton source, compiled or interpreted, which a Python mutation does not reach)
        "tests": ["tests/ops/test_mxfp4_launch.py", "tests/ops/test_mxfp4_bounds.py"],
        "functions": ["mxfp4_launch_config", "mxfp4_grouped_gemm", "mxfp4_tile_cost", "mxfp4_within_bound"],
        "canary": None,
    },
    "vllm/experts/gpu": {   # in this process, with vLLM's kernels and lookups recorded (the interpreter tier
        # runs them for real in the vLLM environment, where mutmut's stats pass cannot see it)
        # test_expert_bytes drives the fused-activation branch (its launches recorded on meta tensors)
        "tests": ["tests/vllm/test_gpu_experts_decisions.py", "tests/ops/test_grouped_blocks.py",
                  "tests/ops/test_expert_bytes.py"],
        "canary": None,
    },
    "vllm/quantized/engine": {
        "tests": ["tests/vllm/test_quantized_engine_decisions.py"],
        "canary": None,
    },
    "vllm/quantized/hooks": {
        "tests": ["tests/vllm/test_quantized_hooks.py"],
        "canary": None,
    },
    "ops/moonep/sync_free": {   # a one-rank gloo group in this process (test_sync_free.py spawns 2 and 4 ranks)
        "tests": ["tests/ops/test_sync_free_decisions.py", "tests/ops/test_sync_free_units.py"],
        "canary": None,
    },
    "vllm/cpu/moe_graphs": {   # vLLM's modular kernel a stand-in in this process (the engine tier runs the real one)
        "tests": ["tests/vllm/test_moe_graphs_decisions.py"],
        "canary": None,
    },
    "ops/moonep/instrument": {   # a one-rank gloo group in this process (tests/ops/test_instrument.py spawns two ranks)
        "tests": ["tests/ops/test_instrument_decisions.py"],
        "canary": None,
    },
    "memory/cuda_probe": {   # the NVLink clique: trusted, or unknown with the reason
        "tests": ["tests/memory/test_multicast_decisions.py", "tests/memory/test_cuda_domain.py"],
        "select": ["-m", "not slow"],
        "functions": ["fabric_clique"],
        "canary": None,
    },
    "memory/symmetric": {   # whether multicast is used: its size, the lockstep bind, going on without it
        "tests": ["tests/memory/test_multicast_decisions.py"],
        "functions": ["_driver_failure", "SymmetricMemory._setup_multicast_or_go_without",
                      "SymmetricMemory._setup_multicast", "SymmetricMemory._bind_multicast_in_lockstep",
                      "SymmetricMemory.has_multicast", "SymmetricMemory.multicast_write"],
        "canary": None,
    },
    "memory/multimem": {   # the multicast store's launch and its refusal of a misaligned write
        "tests": ["tests/memory/test_multicast_decisions.py", "tests/memory/test_cuda_emulator.py"],
        "canary": None,
    },
    "vllm/checkpoint/model_check": {   # the checkpoint check before any engine starts: shapes, activation, quantization verdict
        "tests": ["tests/cli/test_model_check.py", "tests/vllm/test_quantized_schemes.py"],
        "canary": None,
    },
    "vllm/observe/peer_naming": {
        "tests": ["tests/vllm/test_plugin.py"],
        # it reads the repository's pyproject.toml and the installed distribution's entry points: the scratch
        # copy has a generated pyproject.toml without them, and the test does not touch peer_naming.py
        "select": ["--deselect", "tests/vllm/test_plugin.py::test_entry_point_is_declared_and_installed"],
        "canary": None,
    },
}

_SAME_FILL_KEYS = ("w_bytes and s_bytes have the same keys: pull_slots counts every tensor of each used slot for "
                   "the same experts, and every quantized format's views hold scale tensors beside the weights")

# mutant name -> why it cannot change anything observable. Excluded from the score.
EQUIVALENT: dict[str, str] = {
    "moonep_ep.vllm.checkpoint.model_check.x__quantization_problems__mutmut_23":
        "message.partition for rpartition: every refusal of vllm/checkpoint/schemes.py with one reason holds exactly one "
        "'. Fix: ', so both split at the same place",
    "moonep_ep.vllm.checkpoint.model_check.x__quantization_problems__mutmut_29":
        "(message, 'XXXX', '') for (message, '', ''): the middle item is discarded (text, _, fix)",
    "moonep_ep.ops.moonep.padding.x_replan_without_padding__mutmut_2":
        "tokens_per_expert.to(None) for .to(torch.int64): the plan's counts are int32, the in-place subtraction "
        "of the int64 padding matrix stays exact, and plan_dispatch converts its input to int64 itself",
    "moonep_ep.vllm.store.loading.x__checkpoint_problems__mutmut_53":
        "k.split('.') for k.split('.', 1): the keys are '<projection>.<tensor>', one dot, same second part",
    "moonep_ep.vllm.store.loading.x__checkpoint_problems__mutmut_56":
        "k.split('.', 2) for k.split('.', 1): the keys are '<projection>.<tensor>', one dot, same second part",
    "moonep_ep.vllm.store.loading.x__checkpoint_problems__mutmut_54":
        "k.rsplit('.', 1) for k.split('.', 1): the keys are '<projection>.<tensor>', one dot, same second part",
    "moonep_ep.vllm.store.loading.x__format_problems__mutmut_28":
        "engine 'XXvllmXX' for 'vllm': classify compares the engine only with 'vllm-cpu' (both are not it), and "
        "_format_problems reads the scheme's ok, problems and format, never its engine",
    "moonep_ep.vllm.store.loading.x__format_problems__mutmut_29":
        "engine 'VLLM' for 'vllm': classify compares the engine only with 'vllm-cpu' (both are not it), and "
        "_format_problems reads the scheme's ok, problems and format, never its engine",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_104":
        "tokens_per_expert.to(None) for .to(torch.int64): torch.equal compares values, not dtypes (int32 vs int64)",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_109":
        "tokens_per_expert.to(None) for .to(torch.int64): != of int64 and int32 compares the values",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_135": "searchsorted's right=False is its default",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_145": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_147": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_149":
        "tpe_cumsum.to(None) for .to(torch.int64): the plan stores it as int32, so every value fits int32, and the sums it enters are promoted to int64 by their other int64 operand",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_164":
        "alloc_cumsum.to(None) for .to(torch.int64): the plan stores it as int32, so every value fits int32, and the sums it enters are promoted to int64 by their other int64 operand (searchsorted takes an int32 sequence)",
    "moonep_ep.ops.moonep.planner.x_entry_dst__mutmut_197":
        "expert_off.to(None) for .to(torch.int64): the plan stores it as int32, so every value fits int32, and the sums it enters are promoted to int64 by their other int64 operand",
    "moonep_ep.ops.moonep.planner.x__counts_array__mutmut_17":
        "an integer tensor kept in its own dtype (.to(None)): numpy sums small integer dtypes in int64 and torch's "
        "cumsum promotes integer tensors to int64, so the plan is the same (test_counts_of_any_integer_dtype_give_"
        "the_same_plan runs int32 and uint8 tensors)",
    "moonep_ep.ops.moonep.planner.x__counts_array__mutmut_32":
        "dtype kinds 'XXiuXX' for 'iu': 'i' and 'u' are still in the string, and no numpy dtype kind is 'X'",
    "moonep_ep.ops.moonep.planner.x__counts_array__mutmut_65":
        "astype(None) (float64) for astype(int64): every accepted plan has counts below S*K < 2^31, exact in "
        "float64, and every table is built from Python ints or converted to int32",
    "moonep_ep.ops.moonep.planner.x__destination_tables__mutmut_4":
        "remote_stats rows start [1, 0]: index 0 of every row is assigned (remote_stats[d][0] = len(remote)) for "
        "every d before it is read",
    "moonep_ep.ops.moonep.planner.x__destination_tables__mutmut_79":
        "copy_owner e // epn also for e = -1: -1 // epn is -1 for every positive epn, the value the else gives",
    "moonep_ep.ops.moonep.planner.x__destination_tables__mutmut_80":
        "copy_owner e / epn for e // epn: e >= 0, and i32() builds an int64 tensor, which truncates the quotient "
        "toward zero, i.e. floors it",
    "moonep_ep.ops.moonep.planner.x__every_expert_then_slots__mutmut_7":
        "-2 for -1 as the mark of a slotted expert's own group: _destination_tables reads a group's expert only "
        "through 'e >= 0'",
    "moonep_ep.ops.moonep.planner.x__split_tokens__mutmut_14":
        "rem = C[h*epn:(h+2)*epn]: only rem[0:epn] is read (j ranges over range(epn))",
    "moonep_ep.ops.moonep.planner.x__split_tokens__mutmut_33":
        "rem[j] < 0 for <= 0 in the donor-exhausted check that cannot be reached (a donor group never sends more "
        "than it holds: z[h] sums to balance[h] < sum(rem))",
    "moonep_ep.ops.moonep.planner.x__split_tokens__mutmut_35":
        "return for break in the same unreachable donor-exhausted check",
    "moonep_ep.ops.moonep.planner.x__split_tokens__mutmut_41":
        "alloc[..][d] = take for +=: each (expert, destination) pair is served at most once (after a take either "
        "the expert's rem or the destination's quota is 0, and the max never picks it again), and the cell starts "
        "at 0 (d != h: z[h][h] is 0)",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_130":
        "the proven bound's assert weakened ('or'): it holds for every plan, so neither form fails",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_132":
        "the proven bound's assert on row[1] for row[-1]: cu_seqlens rows are nondecreasing, so it holds too",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_133":
        "the proven bound's assert on row[-2] for row[-1]: cu_seqlens rows are nondecreasing, so it holds too",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_39": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_41": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_46": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_48": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_51": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.planner.x_build_plan__mutmut_53": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.memory.exchange.x_vote__mutmut_147":
        "len(set(known)) >= 1 for > 1: with one known multicast clique, first (rank 0's, else the first known) is "
        "that clique, so no reported clique differs from it and no rank is added",
    "moonep_ep.vllm.observe.peer_naming.x_patch_dp_batch_sync__mutmut_13":
        "getattr(orig, '_moonep_ep_wrapped', None) for False: only its truth is read, and None is false too",
    "moonep_ep.vllm.observe.peer_naming.x_patch_engine_core__mutmut_22":
        "getattr(orig, '_moonep_ep_wrapped', None) for False: only its truth is read, and None is false too",
    "moonep_ep.vllm.observe.peer_naming.x_named_loss__mutmut_10":
        "type(None).__name__ for type(exc).__name__ in the text lost_peers reads: it reads only the [address]:port "
        "parts of it (the error's own text is what the PeerLostError carries)",
    "moonep_ep.vllm.observe.peer_naming.x_named_loss__mutmut_11":
        "None for -1 as the own rank when the rank is unknown: lost_peers skips index r when r != rank fails, "
        "and no index equals either",
    "moonep_ep.vllm.observe.peer_naming.x_named_loss__mutmut_14":
        "-2 for -1 as the own rank when the rank is unknown: no table index equals either",
    "moonep_ep.layout.plan.xǁExpertRegionPlanǁdata_bytes_in_pages_of__mutmut_19":
        "max(1, ...) for max(0, ...): never clamps, every page holds data (the lead pad is under one page and "
        "the data ends with the last page)",
    "moonep_ep.layout.formats.x__tensors__mutmut_10":
        "role='weight' dropped: ProjectionSpec's role defaults to 'weight'",
    "moonep_ep.layout.formats.x__tensors__mutmut_20": "rstrip('XX_XX') for rstrip('_'): rstrip takes a set of characters, and no projection prefix (gate_, up_, down_, w13_, w2_) ends in 'X'",
    "moonep_ep.layout.formats.x__tensors__mutmut_45": "rstrip('XX_XX') for rstrip('_'): rstrip takes a set of characters, and no projection prefix (gate_, up_, down_, w13_, w2_) ends in 'X'",
    "moonep_ep.layout.formats.x__tensors__mutmut_27":
        "'or' for 'and' in an assertion of an invariant: every format with scales has both its scale dtype and its "
        "scale tensor name, so neither form fails",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_25":
        "role='weight' dropped: ProjectionSpec's role defaults to 'weight'",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_70":
        "role='weight' dropped: ProjectionSpec's role defaults to 'weight'",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_56":
        "group formats (scale_block (1, 32)) through the block-scale branch: rows = 1 gives w13 scales "
        "[2*ceil(I/1), ceil(H/32)] = [2I, H/32] (check_dims makes H a multiple of 32), the names 'w13_' + name and "
        "projection 'w13': what _tensors builds; bf16 (not quantized, scale_block (1, 1)) stays out either way",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_57":
        "scale_block[1] > 1 for [0]: fp8-block (128, 128) takes the block branch either way; the group formats "
        "(1, 32) take it and build the same specs (as x_expert_projections__mutmut_56)",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_58":
        "scale_block[0] >= 1: the group formats take the block branch and build the same specs (as "
        "x_expert_projections__mutmut_56)",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_59":
        "scale_block[0] > 2 for > 1: the first block dimension is 1 or 128, never 2",
    "moonep_ep.layout.formats.x_get_format__mutmut_9":
        "_ALIASES.get(key, None) for '': FORMATS.get(None) and FORMATS.get('') are both None",
    "moonep_ep.layout.formats.x_get_format__mutmut_11":
        "_ALIASES.get(key) for _ALIASES.get(key, ''): FORMATS.get(None) and FORMATS.get('') are both None",
    "moonep_ep.layout.formats.x_get_format__mutmut_12":
        "_ALIASES.get(key, 'XXXX') for '': no format is named 'XXXX', so FORMATS.get gives None either way",
    "moonep_ep.layout.formats.x_get_format__mutmut_28":
        "group > 1 for > 0: the group is a non-negative int, and 1 fails the multiple-of-8 test either way",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_21":
        "projection=None for the split weight: ProjectionSpec takes its name for an empty projection, and the "
        "split weights are named after their projection (gate, up, down)",
    "moonep_ep.layout.formats.x_expert_projections__mutmut_26":
        "projection= dropped for the split weight: as x_expert_projections__mutmut_21",
    "moonep_ep.ops.moonep.padding.x_real_entries__mutmut_2":
        "route_count kept int32 (.to(None)): its cumsum is int64 (torch promotes integer cumsums) and the other "
        "operands are int64, so the result and its dtype are the same",
    "moonep_ep.ops.moonep.padding.x_real_entries__mutmut_9":
        "tokens_per_expert kept int32 (.to(None)): compared with and subtracted from the int64 padding matrix, "
        "which promotes it; the values are the same",
    "moonep_ep.ops.moonep.padding.x__pad_matrix__mutmut_15": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.moonep.padding.x__pad_matrix__mutmut_17": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x_group_padding__mutmut_47":
        "P[s][s] = take for +=: P starts at zero and the own-group pass is the first write to P[s][s]",
    "moonep_ep.ops.decode.padding.x_group_padding__mutmut_60":
        "P[s][h] = take for +=: after the own-group pass left[s] or need[s] is 0, so take is 0 for h == s and "
        "the branch is skipped; for h != s the cell is still 0",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_10":
        "repeat_interleave(counts) is by definition repeat_interleave(arange(len(counts)), counts)",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_13": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_15": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.vllm.checkpoint.schemes.x__ct__mutmut_50":
        "fmt = '' for None: every branch that leaves fmt unset appends a problem, and the scheme's format is "
        "None whenever there is one (fmt if not problems else None)",
    "moonep_ep.vllm.checkpoint.schemes.x__non_expert_linears__mutmut_3":
        "the '.mlp.experts.' skip never taken: no expert module (mlp.experts.<e>.<proj>_proj, or a fused "
        "mlp.experts.<tensor>) fullmatches a non-expert kind's pattern (self_attn.*_proj, shared_experts.<proj>_proj, "
        "mlp.<proj>_proj directly under mlp, lm_head), so the skip only saves the scan",
    "moonep_ep.vllm.checkpoint.schemes.x__non_expert_linears__mutmut_4":
        "the '.mlp.experts.' skip never taken ('.MLP.EXPERTS.'): as x__non_expert_linears__mutmut_3",
    "moonep_ep.vllm.checkpoint.schemes.x__quantized_with_moonep__mutmut_42":
        "getattr(hf, 'quantization_config', None) also when hf is None: getattr(None, ..., None) is None, "
        "the value the else branch gives",
    "moonep_ep.vllm.checkpoint.schemes.x_check_vllm_config__mutmut_14":
        "a dict passed through getattr(q, 'to_dict', lambda: q)(): a dict has no to_dict, so it comes back itself",
    "moonep_ep.vllm.checkpoint.schemes.x_checkpoint_module_names__mutmut_41":
        "'<q' (signed) for '<Q' as the safetensors header size: equal below 2**63 bytes, and a header that large "
        "cannot be read anyway (safetensors caps it at 100 MB)",
    "moonep_ep.ops.decode.cost.x_cost_model__mutmut_2":
        "default format 'BF16' for 'bf16': canonical_format reads names case-insensitively (layout.formats' "
        "get_format lower-cases them), so both give bf16",
    "moonep_ep.ops.decode.cost.x_cost_model__mutmut_40":
        "the override label 'nbytes' renamed: the label is only compared with 'tflops', 'link' and 'hbm', and "
        "any other label takes the else branch (the expert bytes)",
    "moonep_ep.ops.decode.cost.x_cost_model__mutmut_41": "the override label 'nbytes' renamed: as mutmut_40",
    "moonep_ep.ops.decode.cost.x_detect_profile__mutmut_17":
        "the key 'h200' never found: the loop then returns nothing for an H200 and detect_profile falls back to "
        "'h200', its default (no GPU name holds h200 and a key tried after it)",
    "moonep_ep.ops.decode.cost.x_detect_profile__mutmut_18": "the key 'h200' never found: as mutmut_17",
    "moonep_ep.ops.decode.padding.x__check__mutmut_25": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x__check__mutmut_27": "torch.tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x__check__mutmut_7":
        ".to(None) for .to(torch.int64): the gathered counts are int64 already (the prepare step's index_add_ "
        "and its token count), and every use takes integer arithmetic either way",
    "moonep_ep.ops.decode.padding.x__group_padding__mutmut_15": "torch.as_tensor of Python ints is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x__group_padding__mutmut_17": "torch.as_tensor of Python ints is int64: as mutmut_15",
    "moonep_ep.ops.decode.padding.x__round_robin__mutmut_15":
        "x - k - epn - 1 for x - k + epn - 1: both floor quotients drop by exactly 2, which cancels in "
        "below(end) - below(begin)",
    "moonep_ep.ops.decode.padding.x__round_robin__mutmut_3": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x__round_robin__mutmut_6": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x_own_padding_row__mutmut_24":
        "a float 0 for begin: below(begin) is 0 in either dtype and the int64 row keeps the integer counts",
    "moonep_ep.ops.decode.padding.x_own_padding_row__mutmut_27": "a float 0 for begin: as mutmut_24",
    "moonep_ep.ops.decode.padding.x_own_padding_row__mutmut_31":
        "torch.full of an int is int64 without dtype= (torch >= 1.8)",
    "moonep_ep.ops.decode.padding.x_own_padding_row__mutmut_35": "torch.full of an int is int64: as mutmut_31",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_14":
        "repeat_interleave(counts) for repeat_interleave(arange(len), counts): the one-tensor form repeats each "
        "index by its count, on the counts' device, int64",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_18": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_21": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.decode.padding.x_padding_ids__mutmut_2":
        "pad_row.to(None) for .to(torch.int64): rows are integer tensors (expert_padding's int64); "
        "repeat_interleave and the sums give the same ids for any integer dtype",
    # ops/experts/grouped_blocks.py
    "moonep_ep.ops.experts.grouped_blocks.x_check_block_size__mutmut_8":
        "block_m & (block_m - 2) for & (block_m - 1): for an int m >= 16 both are 0 exactly when m is a power of two "
        "(m = 2^h + 1 leaves bit 0; m >= 2^h + 2 makes m - 2 keep bit h), and m < 16 is refused before",
    "moonep_ep.ops.experts.grouped_blocks.x_check_block_size__mutmut_26":
        "token_padding <= 1 for <= 0: a padding of 1 is refused either way (1 % block_m is 1, block_m >= 16)",
    "moonep_ep.ops.experts.grouped_blocks.x_check_segments_aligned__mutmut_3":
        "cu_seqlens.to('cpu', None) for .to('cpu', torch.int64): cu_seqlens is an integer tensor (dispatch's int32); "
        "tolist gives the same Python ints in either dtype",
    "moonep_ep.ops.experts.grouped_blocks.x_check_segments_aligned__mutmut_5": "the dtype dropped: as mutmut_3",
    "moonep_ep.ops.experts.grouped_blocks.x_grouped_blocks__mutmut_38": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.experts.grouped_blocks.x_grouped_blocks__mutmut_41": "torch.arange of an int is int64 without dtype=",
    "moonep_ep.ops.experts.grouped_blocks.x_grouped_blocks__mutmut_43":
        "ends kept int32 (.to(None)): searchsorted of int64 starts in int32 ends and starts < ends[-1] compare "
        "values, and both results are converted to int32 after",
    "moonep_ep.ops.experts.grouped_blocks.x_skip_zero_weight_blocks__mutmut_23":
        "pad by max(1, ...) for max(0, ...): the extra trailing False is cut by [: n * m] (the route weights have at "
        "most n * m = blocks * block_m rows)",
    "moonep_ep.ops.experts.grouped_blocks.x_skip_zero_weight_blocks__mutmut_24":
        "pad by n * m + numel for n * m - numel: more trailing False, all cut by [: n * m]",
    # ops/experts/mxfp4_kernel.py (host side)
    "moonep_ep.ops.experts.mxfp4_kernel.x_mxfp4_grouped_gemm__mutmut_36":
        "K / 32 for K // 32 in the scale shape compared: K % 32 is refused just before, so the quotient is a whole "
        "float and the tuples compare equal (2 == 2.0)",
    # vllm/experts/gpu.py
    "moonep_ep.vllm.experts.gpu.x_fit_block_m__mutmut_10":
        "max(block_m, 17) for max(block_m, 16): 16 and 17 have the same bit length (5), so the first power of two "
        "tried is the same for every block_m",
    "moonep_ep.vllm.experts.gpu.x_gpu_grouped_ffn__mutmut_104":
        "cu_seqlens[-1] kept int32 (.to(None)): compared with an int64 arange, which compares the values",
    "moonep_ep.vllm.experts.gpu.x_gpu_grouped_ffn__mutmut_81":
        "unsqueeze(+1) for unsqueeze(-1) of the 1-D route weights: both give [M, 1]",
    # vllm/quantized/engine.py
    "moonep_ep.vllm.quantized.engine.x_method_format__mutmut_37":
        "getattr(quant, 'symmetric', None) for False: only its truth is read, and None is false too",
    "moonep_ep.vllm.quantized.engine.x_method_format__mutmut_70":
        "getattr(method, 'block_quant', None) for False: only its truth is read, and None is false too",
    "moonep_ep.vllm.quantized.engine.x_create_quantized_placeholders__mutmut_16":
        "named_parameters(recurse=None) for recurse=False: torch reads only its truth (named_members)",
    "moonep_ep.vllm.quantized.engine.x__param_name__mutmut_1":
        "named_parameters(recurse=None) for recurse=False: torch reads only its truth (named_members)",
    "moonep_ep.vllm.quantized.engine.x__param_name__mutmut_7":
        "rsplit('.') for rsplit('.', 1): the last part is the same whatever the number of splits",
    "moonep_ep.vllm.quantized.engine.x__param_name__mutmut_10":
        "rsplit('.', 2) for rsplit('.', 1): the last part is the same whatever the number of splits",
    "moonep_ep.vllm.quantized.engine.x_load_quantized_expert__mutmut_50":
        "proj 'XXw2XX' for 'w2': proj is only compared with 'w13' (any other value means w2)",
    "moonep_ep.vllm.quantized.engine.x_load_quantized_expert__mutmut_51":
        "proj 'W2' for 'w2': proj is only compared with 'w13' (any other value means w2)",
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_25":
        "set(w_bytes) & set(s_bytes) for | in the remote experts: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_45":
        "set(w_bytes) & set(s_bytes) for | in bytes_by_expert: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_36":
        "w_bytes.get(e, None) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_38":
        "w_bytes.get(e) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_39":
        "w_bytes.get(e, 1) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_41":
        "s_bytes.get(e, None) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_43":
        "s_bytes.get(e) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_44":
        "s_bytes.get(e, 1) for get(e, 0): " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_58":
        "w_bytes.get(e, None) for get(e, 0) in the remote weight bytes: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_60":
        "w_bytes.get(e) for get(e, 0) in the remote weight bytes: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_61":
        "w_bytes.get(e, 1) for get(e, 0) in the remote weight bytes: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_66":
        "s_bytes.get(e, None) for get(e, 0) in the remote scale bytes: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_68":
        "s_bytes.get(e) for get(e, 0) in the remote scale bytes: " + _SAME_FILL_KEYS,
    "moonep_ep.vllm.quantized.engine.x_prefetch_quantized__mutmut_69":
        "s_bytes.get(e, 1) for get(e, 0) in the remote scale bytes: " + _SAME_FILL_KEYS,
    # vllm/quantized/hooks.py
    "moonep_ep.vllm.quantized.hooks.x__fp8_block_128__mutmut_13":
        "getattr(scale, 'static', None) for False: only its truth is read (bool()), and None is false too",
    "moonep_ep.vllm.quantized.hooks.x__fp8_block_128__mutmut_24":
        "getattr(scale, 'group_shape', None) for (): both are false, so 'or ()' gives () either way",
    # ops/moonep/instrument.py
    "moonep_ep.ops.moonep.instrument.x__is_irecv__mutmut_3":
        "getattr(op.op, '__name__', None) for '': only compared with 'irecv', which neither default is",
    "moonep_ep.ops.moonep.instrument.x__is_irecv__mutmut_16":
        "getattr(op.op, '__name__', 'XXXX') for '': only compared with 'irecv', which neither default is",
    "moonep_ep.ops.moonep.instrument.xǁCollectiveRecorderǁ__enter____mutmut_8":
        "break for continue when a module lacks the op: c10d is the inner loop's last module, and the one name "
        "torch.distributed has and c10d lacks (_broadcast_coalesced) is missing there, so both end the loop",
    "moonep_ep.ops.moonep.instrument.xǁCollectiveRecorderǁ_aliases__mutmut_3":
        "True for an empty tensor in _aliases: its one caller, weight_bytes_in, returns 0 for an empty tensor first",
    "moonep_ep.ops.moonep.instrument.xǁ_Phaseǁ__init____mutmut_2":
        "prev 'XXXX' for '' at construction: __enter__ sets prev before __exit__ reads it",
    # memory/symmetric.py (the multicast decisions)
    "moonep_ep.memory.symmetric.xǁSymmetricMemoryǁ_bind_multicast_in_lockstep__mutmut_5":
        "range(retries + 2) for range(retries + 1): every attempt returns or raises by attempt == retries, so the "
        "extra attempt is never reached",
    "moonep_ep.memory.symmetric.xǁSymmetricMemoryǁ_bind_multicast_in_lockstep__mutmut_35":
        "the retryable code looked for in the error's text (s[1]) instead of its code (s[0]): a driver's DriverError "
        "text names its code (MemoryDriver.error: '<call> -> <code>: <detail>'), so both hold SYSTEM_NOT_READY or "
        "neither does",
    "moonep_ep.memory.symmetric.xǁSymmetricMemoryǁ_bind_multicast_in_lockstep__mutmut_41":
        "rank=None on the bind's CollectiveError: its one reader, _setup_multicast_or_go_without, reads its step and "
        "failures only and builds the MOONEP_EP_MULTICAST=on error with this rank itself",
    "moonep_ep.memory.symmetric.xǁSymmetricMemoryǁ_bind_multicast_in_lockstep__mutmut_44":
        "rank dropped from the bind's CollectiveError: as mutmut_41",
    "moonep_ep.ops.moonep.sync_free.x__comm_plan__mutmut_13":
        "t.to(device=None, dtype=int32) for device=dev: every table (the device plan, dst, recv_loff, the dedup tables) is already on the buffer's device",
    "moonep_ep.ops.moonep.sync_free.x__comm_plan__mutmut_15":
        "t.to(dtype=int32) without device=dev: as mutmut_13",
    "moonep_ep.ops.moonep.sync_free.x__dedup_tables__mutmut_56":
        "grouped.to(None) for .to(torch.int64): cumsum of a bool tensor is int64",
    "moonep_ep.ops.moonep.sync_free.x__dedup_tables__mutmut_103":
        "is_dup.to(None) for .to(torch.int64): cumsum of a bool tensor is int64",
    "moonep_ep.ops.moonep.sync_free.x__dedup_tables__mutmut_69":
        "NvS + 2 spare rows for NvS + 1: the spare rows are cut off ([:NvS])",
    "moonep_ep.ops.moonep.sync_free.x__dedup_tables__mutmut_114":
        "NvS + 2 spare rows for NvS + 1: the spare rows are cut off ([:NvS])",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_19":
        "torch.full(..., -1) without dtype=int64: an int fill value makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_23":
        "torch.full(..., -1) without dtype=int64: an int fill value makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_30":
        "torch.full(..., -1) without dtype=int64: an int fill value makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_34":
        "torch.full(..., -1) without dtype=int64: an int fill value makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_25":
        "dest +1 past the s*K entries: their loff is -1, so meta is -1 for every rank either way",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_26":
        "dest -2 past the s*K entries: as mutmut_25",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_36":
        "loff +1 past the s*K entries: their dest -1 is no rank, so meta is -1 either way",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_37":
        "loff -2 past the s*K entries: as mutmut_36",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_39":
        "clamp(None, R-1) for clamp(0, R-1): raw >= 0 (a duplicate's -dst-1 included), so raw // NvS >= 0",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_51":
        "torch.arange(R) without dtype=int64: an int end makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__exchange_and_place__mutmut_54":
        "torch.arange(R) without dtype=int64: an int end makes it int64",
    "moonep_ep.ops.moonep.sync_free.x__padding_mask__mutmut_2":
        "start.to(None) for .to(torch.int64): int32 starts stay exact (rows < 2**31) and index_add_ takes int32 indices",
    "moonep_ep.ops.moonep.sync_free.x__padding_mask__mutmut_4":
        "count.to(None) for .to(torch.int64): as mutmut_2",
    "moonep_ep.ops.moonep.sync_free.x__padding_mask__mutmut_8":
        "count >= 0 for > 0: a count-0 range adds and removes 1 at the same (clamped) row",
    "moonep_ep.ops.moonep.sync_free.x__padding_mask__mutmut_18":
        "NvS + 2 for NvS + 1 in the difference array: it is cut to [:NvS]",
    "moonep_ep.ops.moonep.sync_free.x_combine__mutmut_202":
        "dst > 0 for >= 0: dst 0 read as a duplicate gives raw -1, -1 // NvS = -1, clamped to rank 0, its rank",
    "moonep_ep.ops.moonep.sync_free.x_combine__mutmut_203":
        "dst >= 1 for >= 0: as mutmut_202",
    "moonep_ep.ops.moonep.sync_free.x_combine__mutmut_208":
        "clamp(None, R-1) for clamp(0, R-1): raw >= 0, so raw // NvS >= 0",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_5":
        "s = None for s = 0 at the start: every path assigns s before reading it (the except sets 0)",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_6":
        "s = 1 for s = 0 at the start: as mutmut_5",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_74":
        "ids = '' for None: ids is read only on a fresh call without an error, where it is assigned",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_130":
        "tpe.to(None) for .to(torch.int64): != of int64 counts and int32 tpe compares the values",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_197":
        "planner_flags zeros without dtype=int64: used only on reuse, where it is 0 and record converts it to int64",
    "moonep_ep.ops.moonep.sync_free.x_dispatch__mutmut_200":
        "planner_flags zeros without dtype=int64: as mutmut_197",
    "moonep_ep.ops.moonep.sync_free.xǁDeferredErrorsǁraise_if_set__mutmut_2":
        "bits.to(None).tolist() for .to('cpu').tolist(): tolist copies a device tensor to the host itself",
    "moonep_ep.ops.moonep.sync_free.xǁDeferredErrorsǁraise_if_set__mutmut_8":
        "bad_id.to(None).tolist() for .to('cpu').tolist(): as mutmut_2",
    "moonep_ep.ops.moonep.sync_free.xǁDeferredErrorsǁraise_if_set__mutmut_87":
        "'XX'-wrapped step name of the CollectiveError: wording; the tests check it names the sync-free dispatch",
    "moonep_ep.ops.moonep.sync_free.xǁDeferredErrorsǁrecord__mutmut_22":
        "planner_flags.to(None) for .to(torch.int64): bitwise_or_ into the int64 word promotes the int32 flag",
    "moonep_ep.vllm.cpu.moe_graphs.x_graph_moe_steps__mutmut_56":
        "signature.bind(None, ...) for bind(self, ...): the bound 'self' is popped and never read, and binding "
        "checks no argument's value",
}

_STATUS = {0: "survived", 1: "killed", 3: "killed", -24: "timeout", 24: "timeout", 152: "timeout",
           255: "timeout", 33: "no tests", 34: "skipped", 35: "suspicious", 36: "timeout", 37: "killed",
           -11: "segfault", -9: "killed (signal 9)", 5: "no tests"}


def _pyproject(spec: dict, module_file: str) -> str:
    tests = ", ".join(json.dumps(t) for t in [*(t for t in spec["tests"] if (ROOT / t).exists()),
                                                *spec.get("select", [])])
    return f"""[tool.mutmut]
source_paths = ["src"]
only_mutate = [{json.dumps(module_file)}]
pytest_add_cli_args_test_selection = [{tests}]
pytest_add_cli_args = ["-p", "no:cacheprovider"]

[tool.pytest.ini_options]
addopts = "--strict-markers"
timeout = 300
markers = [
    "cuda: needs one CUDA GPU with VMM support",
    "multi_gpu: needs two or more CUDA GPUs",
    "nvswitch: needs GPUs on an NVSwitch fabric",
    "slow: multi-process tests",
    "cuda_emulated: CUDA driver emulator",
]
"""


def _prepare(key: str) -> tuple[Path, dict]:
    spec = MODULES[key]
    work = SCRATCH / key.replace("/", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", work / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    (work / "pyproject.toml").write_text(_pyproject(spec, f"src/moonep_ep/{key}.py"))
    # PYTHONPATH names mutants/ and mutants/src before mutmut creates them: a directory missing at start-up
    # would be cached by the import system as having no modules (sys.path_importer_cache) for the whole run.
    (work / "mutants" / "src").mkdir(parents=True)
    return work, spec


def _mutmut_only(work: Path) -> Path:
    """A directory holding mutmut alone (links): the mutated module imports mutmut's trampoline, and the
    vLLM environments have no mutmut; adding this venv's whole site-packages there would mix torch builds."""
    import mutmut

    pkg = Path(mutmut.__file__).resolve().parent
    only = work / "mutmut_only"
    only.mkdir(exist_ok=True)
    for entry in [pkg, *pkg.parent.glob("mutmut-*.dist-info")]:
        link = only / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return only


def _env(work: Path, spec: dict | None = None) -> dict:
    env = dict(os.environ)
    if spec and spec.get("max_examples"):   # tests/support/hypothesis_budget.py caps each property test's examples
        env["MOONEP_EP_TEST_MAX_EXAMPLES"] = str(spec["max_examples"])
    env["PYTHONPATH"] = os.pathsep.join([str(work / "mutants" / "src"), str(work / "mutants"),
                                         str(_mutmut_only(work))])
    env.pop("MUTANT_UNDER_TEST", None)
    # tests/support/vllm_envs.py finds the vLLM environments beside the tests' root, the scratch copy here
    for var, venv in (("MOONEP_EP_VLLM_PYTHON", ".venv-vllm"), ("MOONEP_EP_VLLM_CPU_PYTHON", ".venv-vllm-cpu")):
        if (ROOT / venv / "bin" / "python").exists():
            env.setdefault(var, str(ROOT / venv / "bin" / "python"))
    env.setdefault("OMP_NUM_THREADS", "1")   # mutants are forked from a process that ran torch: one thread each
    return env


def _canary(key: str, work: Path, spec: dict) -> None:
    """mutmut's forced-fail mutant must be what a fresh interpreter of each environment imports."""
    module = "moonep_ep." + key.replace("/", ".")
    env = _env(work) | {"MUTANT_UNDER_TEST": "fail"}
    interpreters = [sys.executable]
    for venv in (".venv-vllm", ".venv-vllm-cpu"):
        py = ROOT / venv / "bin" / "python"
        if py.exists() and any("tests/vllm/" in t for t in spec["tests"]):
            interpreters.append(str(py))
    for py in interpreters:
        canary_env = env
        code = (f"import {module} as m, sys; f = m.__file__; "
                f"assert f.startswith({str(work / 'mutants')!r}), f; "
                "names = [n for n, v in vars(m).items() if callable(v) and n.startswith('x_') is False "
                "and getattr(v, '__module__', '') == m.__name__ and hasattr(m, 'x_' + n + '__mutmut_orig')]; "
                "assert names, 'no trampolined function'; "
                "fn = getattr(m, names[0]);\n"
                # a generator function's body (and its forced failure) runs when the generator is iterated
                "try:\n    result = fn()\n    if hasattr(result, '__next__'):\n        next(result)\n"
                "except BaseException as e:\n"
                "    sys.exit(0 if type(e).__name__ == 'MutmutProgrammaticFailException' else "
                "f'{type(e).__name__}: {e}')\n"
                "sys.exit('the fail mutant did not fail')")
        proc = subprocess.run([py, "-c", code], cwd=work / "mutants", env=canary_env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"canary failed for {key} in {py}: the tests would not run the mutants\n"
                             f"{proc.stdout}{proc.stderr}")


def _function_of(mutant: str) -> str:
    """``func`` or ``Class.method`` of a mutant name: mutmut 3 names a function's mutants
    ``<module>.x_<func>__mutmut_<n>`` and a method's ``<module>.xǁ<Class>ǁ<method>__mutmut_<n>``."""
    match = re.fullmatch(r"x(?:ǁ(\w+)ǁ|_)(\w+?)__mutmut_\d+", mutant.rsplit(".", 1)[-1])
    if match is None:
        raise SystemExit(f"not a mutmut 3 mutant name: {mutant}")
    cls, fn = match.groups()
    return f"{cls}.{fn}" if cls else fn


def _mutant_pattern(module: str, function: str) -> str:
    """mutmut's name pattern for the mutants of one ``func`` or ``Class.method`` (see :func:`_function_of`)."""
    cls, _, fn = function.rpartition(".")
    return f"{module}.xǁ{cls}ǁ{fn}__mutmut_*" if cls else f"{module}.x_{fn}__mutmut_*"


def _results(work: Path, key: str, spec: dict) -> dict:
    meta = work / "mutants" / "src" / "moonep_ep" / f"{key}.py.meta"
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    patterns = spec.get("functions")
    counts: dict[str, int] = {}
    survivors, equivalent = [], []
    for name, code in sorted(codes.items()):
        if patterns and _function_of(name) not in patterns:
            continue
        if code is None:
            status = "not run"
        else:
            status = _STATUS.get(code, f"exit {code}")
        if name in EQUIVALENT:
            equivalent.append(name)
            continue
        counts[status] = counts.get(status, 0) + 1
        if status not in ("killed", "timeout"):
            survivors.append(f"{name}: {status}")
    total = sum(counts.values())
    caught = counts.get("killed", 0) + counts.get("timeout", 0)
    return {"module": key, "caught": caught, "total": total, "equivalent": len(equivalent),
            "score": round(100.0 * caught / total, 1) if total else None, "counts": counts,
            "survivors": survivors}


def run_module(key: str, timeout_s: int) -> dict:
    work, spec = _prepare(key)
    start = time.monotonic()
    env = _env(work, spec)
    args = [sys.executable, "-c", "from mutmut.__main__ import cli; cli()", "run", "--max-children", "2"]
    if spec.get("functions"):
        module = "moonep_ep." + key.replace("/", ".")
        args += [_mutant_pattern(module, fn) for fn in spec["functions"]]
    with open(work / "mutmut.log", "w") as log:
        try:
            subprocess.run(args, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.write(f"\nstopped after {timeout_s} s\n")
    if not (work / "mutants" / "src" / "moonep_ep" / f"{key}.py.meta").exists():
        raise SystemExit(f"mutmut wrote no mutants for {key}; see {work / 'mutmut.log'}")
    _canary(key, work, spec)
    result = _results(work, key, spec)
    result["seconds"] = round(time.monotonic() - start)
    return result


def main(argv: list[str]) -> int:
    keys = argv or sorted(MODULES, key=lambda k: (ROOT / "src" / "moonep_ep" / f"{k}.py").stat().st_size
                          if not MODULES[k].get("functions") else 0)   # small first: partial runs say the most
    unknown = [k for k in keys if k not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    timeout_s = int(os.environ.get("MUTATE_TIMEOUT_S", "1800"))
    results = []
    t0 = time.monotonic()
    for key in keys:
        r = run_module(key, timeout_s)
        results.append(r)
        print(f"{key:22s} {r['caught']:4d}/{r['total']:<4d} {r['score']}%  ({r['equivalent']} equivalent "
              f"excluded, {r['seconds']} s) {r['counts']}", flush=True)
        for s in r["survivors"]:
            print(f"    {s}")
        (SCRATCH / "scores.json").write_text(json.dumps(results, indent=1))   # after each module
    print(f"total time {round(time.monotonic() - t0)} s")
    (SCRATCH / "scores.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["score"] is not None and r["score"] >= 90 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
