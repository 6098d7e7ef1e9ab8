"""Constrained decoding: a request's JSON schema, regex, choice or grammar turned into a token mask per step.

`backend.py` picks and builds a backend (llguidance by default, xgrammar on request), `bitmask.py` applies a
batch of bitmasks to the logits, `manager.py` is what the engine core holds: one grammar state per sequence.
"""
