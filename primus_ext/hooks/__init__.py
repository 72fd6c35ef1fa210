"""The proofs about user hooks: whether a ``mask_mod`` / ``score_mod`` equals a fixed pattern.

A hook is checked against the provable subset (`subset`, allow-list in `allowlist`), traced
(`trace`), encoded as exact z3 formulas (`encoder`, per-op meanings in `ops`), decided by the
solver (`solver`; distance-only masks without it, `window`; score hooks, `score`), and the
proof cross-checked against the hook called as torch calls it (`crosscheck`); `proof` is the
entry.  It reads the mask vocabulary (`primus_ext.attention`) and nothing above it; the plan
reads its verdicts.
"""
