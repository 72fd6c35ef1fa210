"""Benchmarks of primus_ext, each printing one side-by-side table and writing JSON.

Run one from the repository root with ``python -m benchmarks.<name>``, or several with
``primus-ext bench [NAME ...]`` (which runs each module in its own process, from the
checkout this package lives in).  Results go to ``benchmarks/results/<name>.json``.

* ``adapter_overhead``: the flex adapter's per-call Python cost against a direct
  ``flash_attn_func``-style call of the same no-op kernel stub.
* ``copies_and_syncs``: exact counts of tensor copies and host syncs per call on each path.
* ``reference_vs_sdpa``: the reference backend against ``scaled_dot_product_attention``,
  forward + backward on CPU.
* ``gpt_step``: a tiny megatron-core GPT training step, flex path against direct path.
* ``eod_packing``: `pack_eod_micro_batch` per micro-batch against the dense-mask attention
  it replaces (``reset_attention_mask``), at S = 4k and 32k.
* ``flex_blockmask``: document BlockMasks per step of 24 layers on the ``flex`` backend, shared
  (one build) against built per layer, beside torch's ``create_block_mask``, at 8k and 32k.
* ``hook_proofs``: what proving user mask / score hooks (B31) costs a 96-layer model
  build, at 4k and 128k tokens.
* ``shared_prefix``: RL shared-prefix rows (`pack_shared_prefix`) against the duplicated layout
  (each response after its own prompt copy): tokens, GPT step time, attention time and memory,
  P = 1k and 4k, n = 4 and 16, R = 512.
"""

NAMES = ("adapter_overhead", "copies_and_syncs", "reference_vs_sdpa", "gpt_step", "hook_proofs", "eod_packing",
         "flex_blockmask", "shared_prefix")
