"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the verification of their proposals
against the target's logits, and the policy of who speculates how far (decoder)."""
