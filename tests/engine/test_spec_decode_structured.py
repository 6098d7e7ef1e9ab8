"""Speculative decoding under structured output (SmolLM2, llguidance): proposals are cut to what the grammar
accepts and each verification row is masked by the grammar's state after the proposals before it, so greedy
constrained output equals plain decoding's and sampled output still validates."""

from __future__ import annotations

import json

import jsonschema

from cpuinfer.engine.messages import AddRequest
from cpuinfer.sampling_params import SamplingParams, StructuredOutputsParams
from cpuinfer.spec_decode.config import SpeculativeConfig
from cpuinfer.spec_decode.decoder import SpecDecoder
from cpuinfer.spec_decode.proposer import NgramProposer

from .test_structured_outputs import PERSON, chat_ids, drain, grammars, make_core, texts  # noqa: F401 - fixture

PROMPT = "Describe a person called Anna, 31, with a cat and a dog, as JSON."


class Scrambled:
    """A proposer of tokens the grammar mostly refuses: the n-gram proposals of the prompt, reversed."""

    def __init__(self):
        self.inner = NgramProposer(1, 2)

    def propose(self, seqs, ks):
        return [d[::-1] for d in self.inner.propose(seqs, ks)]

    def drop(self, rid):
        self.inner.drop(rid)


def run(core, spec, constraint, prediction=None, temperature=0.0, n=1):
    sp = SamplingParams(
        temperature=temperature, max_tokens=64, seed=3, structured_outputs=constraint, prediction=prediction, n=n
    )
    prompt = chat_ids(spec, PROMPT)
    ids = [f"r{i}" for i in range(n)] if n > 1 else []
    msg = AddRequest("r", prompt, sp, ids)
    if prediction:  # what the output processor does
        msg.prediction_token_ids = spec.tokenizer.encode(prediction, add_special_tokens=False).ids
    core.add_request(msg)
    return drain(core)[0]


def test_greedy_constrained_identical_and_valid(smol_runner, smol_spec, grammars):  # noqa: F811 - fixture
    constraint = StructuredOutputsParams(json=PERSON)
    plain = run(make_core(smol_runner, smol_spec, grammars), smol_spec, constraint)
    text = texts(smol_spec, plain)["r"]
    jsonschema.validate(json.loads(text), PERSON)
    for proposer, prediction in ((NgramProposer(1, 3), text), (Scrambled(), None)):
        core = make_core(smol_runner, smol_spec, grammars)
        core.spec = SpecDecoder(SpeculativeConfig("ngram", 4), proposer, 512)
        got = run(core, smol_spec, constraint, prediction)
        assert got == plain
        assert core.spec.stats.num_draft_tokens > 0
        assert core.pool.num_free == core.pool.num_blocks
    assert core.spec.stats.num_accepted_tokens < core.spec.stats.num_draft_tokens


def test_sampled_constrained_outputs_validate(smol_runner, smol_spec, grammars):  # noqa: F811 - fixture
    core = make_core(smol_runner, smol_spec, grammars)
    core.spec = SpecDecoder(SpeculativeConfig("ngram", 4), NgramProposer(1, 3), 512)
    got = run(core, smol_spec, StructuredOutputsParams(json=PERSON), temperature=0.8, n=6)
    for text in texts(smol_spec, got).values():
        jsonschema.validate(json.loads(text), PERSON)
    assert core.spec.stats.num_accepted_tokens > 0
