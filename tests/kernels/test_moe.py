"""The mixture-of-experts MLP kernel (MoE) per variant: against a float32 torch reference built here from the
same weights, batch invariance (a row's bits do not depend on which rows share its call or its experts), the
f32 share for tensor parallelism, and the plan checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cpuinfer.models.plan import MoEMLP

H, INTER, E = 128, 64, 8


def _plan(kernels, dtype, top_k=2, scoring="softmax", renormalize=True, packed=False, router_bias=False):
    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    plan = MoEMLP(
        router_w=w(E, H) * 4,  # spread the router's logits so that the top-k has clear margins
        gate_up_w=[w(2 * INTER, H) for _ in range(E)],
        down_w=[w(H, INTER) for _ in range(E)],
        top_k=top_k,
        act="silu",
        scoring=scoring,
        renormalize=renormalize,
        router_b=w(E) if router_bias else None,
    )
    if not packed:
        return plan, plan

    def pack(t):
        out = torch.empty_like(t)
        kernels.linear_pack_weight(out, t)
        return out

    return plan, dataclasses.replace(
        plan,
        router_w=pack(plan.router_w),
        gate_up_w=[pack(t) for t in plan.gate_up_w],
        down_w=[pack(t) for t in plan.down_w],
    )


def _margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: how far the k-th best score is above the next (infinite when every expert is chosen)."""
    if k == scores.shape[-1]:
        return torch.full((scores.shape[0],), float("inf"))
    top = torch.topk(scores, k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def _reference(plan: MoEMLP, x: torch.Tensor):
    """float32 torch over the same (rounded) weights: routing as transformers does it, experts summed in f32."""
    logits = x.float() @ plan.router_w.float().T
    if plan.router_b is not None:
        logits = logits + plan.router_b.float()
    logits = logits.to(x.dtype).float()  # the model's router projection is in the run dtype
    if plan.scoring == "topk_softmax":
        top, ids = torch.topk(logits, plan.top_k, dim=-1)
        weights = torch.softmax(top, -1)
        margin = _margin(logits, plan.top_k)
    else:
        probs = torch.softmax(logits, -1)
        weights, ids = torch.topk(probs, plan.top_k, dim=-1)
        margin = _margin(probs, plan.top_k)
        if plan.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], H)
    for r in range(x.shape[0]):
        for j in range(plan.top_k):
            e = int(ids[r, j])
            gu = x[r].float() @ plan.gate_up_w[e].float().T
            a = (F.silu(gu[:INTER]) * gu[INTER:]).to(x.dtype).float()  # the kernel rounds the activation to dt
            out[r] += weights[r, j] * (a @ plan.down_w[e].float().T)
    return out, margin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "top_k,scoring,renormalize,router_bias",
    [
        (2, "softmax", True, False),
        (3, "softmax", False, False),
        (2, "topk_softmax", True, True),
        (8, "softmax", True, False),
    ],
)
def test_moe_matches_torch(kernels, dtype, packed, top_k, scoring, renormalize, router_bias):
    plan, run = _plan(kernels, dtype, top_k, scoring, renormalize, packed, router_bias)
    x = torch.randn(37, H).to(dtype)
    out = torch.empty_like(x)
    kernels.MoE(run, packed).forward(out, x)
    ref, margin = _reference(plan, x)
    clear = margin > 2e-3  # rows whose k-th expert is not a near-tie (rounding may pick either there)
    assert clear.sum() >= 25
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float()[clear], ref[clear], atol=tol, rtol=tol)


@pytest.mark.parametrize("packed", [False, True])
def test_moe_rows_independent_of_their_batch(kernels, packed):
    """A row alone, in a batch of others, and in a batch sharing none or all of its experts: the same bits."""
    _, run = _plan(kernels, torch.bfloat16, packed=packed)
    moe = kernels.MoE(run, packed)
    x = torch.randn(300, H).bfloat16()
    full = torch.empty_like(x)
    moe.forward(full, x)
    for rows in ([0], [5, 6], list(range(0, 300, 7)), list(range(250, 300)), [299, 0, 17]):
        part = torch.empty(len(rows), H, dtype=torch.bfloat16)
        moe.forward(part, x[rows].contiguous())
        assert torch.equal(part, full[rows]), rows


def test_moe_f32_share_is_the_unrounded_sum(kernels):
    """out float32: the f32 sums a tensor-parallel rank all-reduces; rounded, they are the bf16 output."""
    _, run = _plan(kernels, torch.bfloat16)
    moe = kernels.MoE(run, False)
    x = torch.randn(9, H).bfloat16()
    out, share = torch.empty_like(x), torch.empty(9, H)
    moe.forward(out, x)
    moe.forward(share, x)
    assert torch.equal(share.bfloat16(), out)


def test_moe_in_place(kernels):
    """out may be x (the fused layer runs the MLP in place)."""
    _, run = _plan(kernels, torch.bfloat16, packed=True)
    moe = kernels.MoE(run, True)
    x = torch.randn(40, H).bfloat16()
    out = torch.empty_like(x)
    moe.forward(out, x)
    moe.forward(x, x)
    assert torch.equal(x, out)


def test_moe_bad_plans(kernels):
    plan, _ = _plan(kernels, torch.bfloat16)
    cases = [
        (dict(top_k=9), "mlp.top_k is 9; it must be in \\[1, 8\\]"),
        (dict(top_k=0), "mlp.top_k is 0"),
        (dict(down_w=plan.down_w[:7]), "mlp.gate_up_w has 8 experts, mlp.down_w 7"),
        (dict(gate_up_w=[*plan.gate_up_w[:3], plan.gate_up_w[3][:64], *plan.gate_up_w[4:]]), "mlp.gate_up_w\\[3\\]"),
        (dict(router_w=plan.router_w[:6]), "mlp.router_w must be \\[8, 128\\]"),
        (dict(scoring="sigmoid"), "mlp.scoring must be"),
        (dict(act="relu"), "mlp.act must be"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.MoE(dataclasses.replace(plan, **change), False)
    with pytest.raises(TypeError, match="dtype"):
        kernels.MoE(dataclasses.replace(plan, down_w=[w.half() for w in plan.down_w]), False)
    moe = kernels.MoE(plan, False)
    with pytest.raises(ValueError, match="x has 64 features"):
        moe.forward(torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(2, 64, dtype=torch.bfloat16))
