"""Speculative decoding: proposers (n-gram lookup, a draft model, DeepSeek's MTP layer: proposer.py picks),
verification (verify.py, run by the model runner) and the counters (metrics.py).

The target verifies a request's k drafts in one forward of 1 + k tokens: the normal sampler draws a target token at
each of the k + 1 positions (drafts before a position count as generated there), and graphinfer::rejection_sample
keeps the drafts up to the first one that differs from its target token, plus that token (or the bonus token after
k accepted drafts). Drafts are deterministic (lookup, a draft model's or the MTP layer's argmax), for which this is
the exact accept / resample-from-residual rule: the output follows the target distribution
(graphinfer/ops/rejection.py).
"""
