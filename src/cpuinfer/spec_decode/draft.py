"""The draft-model proposer: a small model with the target's tokenizer proposes k tokens greedily.

It runs in the engine core's process, on its threads, with its own ModelRunner and its own small KV cache
(blocks of the target's size, handed out here). Each sequence keeps the tokens whose K/V its draft cache
holds; after a verification step the cache is cut back to what still agrees with the sequence (the rejected
proposals), then one draft step catches up on the new tokens and proposes d_1, and k - 1 one-token steps
propose the rest, all sequences batched together in each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from cpuinfer import ops
from cpuinfer.engine.step import ScheduledSeq
from cpuinfer.spec_decode.config import SpeculativeConfig
from cpuinfer.spec_decode.proposer import SpecSequence
from cpuinfer.worker.model_runner import ModelRunner


def draft_runner(config, speculative: SpeculativeConfig) -> ModelRunner:
    """Load the draft model of `speculative` for the engine `config` (an EngineConfig); refuses a draft whose
    tokenizer differs from the target's."""
    from cpuinfer.model_loader import load_model_spec

    dtype = speculative.dtype if speculative.dtype != "auto" else config.spec.dtype
    draft = load_model_spec(speculative.model, dtype, speculative.quantization)
    check_same_tokenizer(config.spec, draft, speculative.model)
    if draft.max_model_len < config.max_model_len:
        raise ValueError(
            f"--speculative-config: the draft model's context ({draft.max_model_len}) is shorter than "
            f"max_model_len={config.max_model_len}; lower --max-model-len"
        )
    draft = dataclasses.replace(draft, max_model_len=config.max_model_len)
    from cpuinfer.spec_decode.decoder import DEFAULT_DISABLE_BY_BATCH_SIZE

    seqs = min(config.max_num_seqs, speculative.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE)
    bs = config.block_size
    num_blocks = seqs * -(-config.max_model_len // bs)
    return ModelRunner(draft, bs, num_blocks)


def check_same_tokenizer(target, draft, path: str) -> None:
    """ValueError unless the draft maps every token to the same id as the target."""
    tt, dt = target.tokenizer, draft.tokenizer
    same = (
        tt is not None
        and dt is not None
        and tt.get_vocab(with_added_tokens=True) == dt.get_vocab(with_added_tokens=True)
    )
    if not same:
        raise ValueError(
            f"--speculative-config: the draft model {path!r} does not have the target model's tokenizer "
            f"(vocabularies of {target.vocab_size} and {draft.vocab_size} entries, or token ids that differ); "
            "a draft model must share the target's tokenizer"
        )


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # whose K/V the draft cache holds, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy proposals of a draft model (so each is proposed with certainty: q one-hot in the verification)."""

    def __init__(self, runner: ModelRunner, k: int):
        self.runner = runner
        self.k = k
        self.block_size = runner.block_size
        self.free = list(range(runner.num_blocks - 1, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}

    def propose(self, seqs: list[SpecSequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens per sequence (none for a sequence the draft cache has no room for)."""
        out: list[list[int]] = [[] for _ in seqs]
        live = [i for i, (s, k) in enumerate(zip(seqs, ks, strict=True)) if k > 0 and self._room(s, k, seqs)]
        if not live:
            return out
        steps = []
        for i in live:
            s, st = seqs[i], self.seqs[seqs[i].request_id]
            c = _common_prefix(st.tokens, s.all_token_ids)
            del st.tokens[c:]
            steps.append(ScheduledSeq(s.all_token_ids[c:], c, st.blocks, True))
            st.tokens.extend(s.all_token_ids[c:])
        for r in range(max(ks[i] for i in live)):
            if r > 0:
                live = [i for i in live if ks[i] > r]
                steps = [
                    ScheduledSeq(
                        [out[i][-1]],
                        len(self.seqs[seqs[i].request_id].tokens),
                        self.seqs[seqs[i].request_id].blocks,
                        True,
                    )
                    for i in live
                ]
                for i in live:
                    self.seqs[seqs[i].request_id].tokens.append(out[i][-1])
            logits = self.runner.execute(steps)
            for i, t in zip(live, ops.argmax(logits).tolist(), strict=True):
                out[i].append(t)
        return out

    def _room(self, s: SpecSequence, k: int, batch: list[SpecSequence]) -> bool:
        """Blocks for s's tokens and k proposals; frees other sequences' draft caches (outside this batch) if
        the pool is short. False when there is no room."""
        st = self.seqs.setdefault(s.request_id, _DraftSeq())
        need = -(-(len(s.all_token_ids) + k - 1) // self.block_size) - len(st.blocks)
        if need > len(self.free):
            keep = {b.request_id for b in batch}
            for rid in [r for r in self.seqs if r not in keep]:
                self.drop(rid)
                if need <= len(self.free):
                    break
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            st.blocks.append(self.free.pop())
        return True

    def drop(self, request_id: str) -> None:
        """Give a sequence's draft cache blocks back."""
        st = self.seqs.pop(request_id, None)
        if st is not None:
            self.free.extend(reversed(st.blocks))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = torch.tensor(a[:n]) != torch.tensor(b[:n])
    return int(x.int().argmax())
