"""A vLLM general plugin that breaks the mamba state resume on purpose: the negative control of the
identity check in tests/test_patch_mamba.py.

Loaded by vLLM itself (entry point group ``vllm.general_plugins``, which every worker loads at
start) when the test puts this folder and a dist-info naming it on the server's PYTHONPATH.
With ``RIG_FAULT_MAMBA_RESUME=zero`` it wraps the worker's ``mamba_utils.preprocess_mamba``:
after vLLM has copied a resuming request's state (a prefix-cache hit: a new request whose
computed tokens are > 0) from the checkpoint block into its running block, it zeroes both, in
every mamba layer. The request then continues from a zero recurrent state, which is what a
wrong resume (a freed-and-reused or never-written checkpoint) would look like. Requests that do
not resume (from scratch, decode steps) are untouched.
"""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("RIG_FAULT_MAMBA_RESUME") != "zero":
        return
    from vllm.v1.worker import mamba_utils

    real = mamba_utils.preprocess_mamba
    if getattr(real, "rig_fault", False):
        return

    def preprocess_mamba(scheduler_output, kv_cache_config, cache_config, mamba_state_idx, input_batch, requests,
                         forward_context, mamba_state_copy_funcs, copy_bufs, *args, **kwargs):
        block_size = copy_bufs.mamba_spec.block_size
        resuming = {rid: (requests[rid].num_computed_tokens - 1) // block_size for rid in input_batch.req_ids
                    if rid not in mamba_state_idx and requests[rid].num_computed_tokens > 0}
        real(scheduler_output, kv_cache_config, cache_config, mamba_state_idx, input_batch, requests,
             forward_context, mamba_state_copy_funcs, copy_bufs, *args, **kwargs)
        for rid, hit_idx in resuming.items():
            for gid in copy_bufs.mamba_group_ids:
                block_ids = requests[rid].block_ids[gid]
                for idx in {hit_idx, mamba_state_idx[rid]}:
                    for layer in kv_cache_config.kv_cache_groups[gid].layer_names:
                        for state in forward_context[layer].kv_cache:
                            state[block_ids[idx]].zero_()
        if resuming:
            print(f"rig fault: zeroed the resumed mamba state of {len(resuming)} request(s)", flush=True)

    preprocess_mamba.rig_fault = True
    mamba_utils.preprocess_mamba = preprocess_mamba
