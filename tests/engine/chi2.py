"""A chi-square goodness-of-fit p-value (torch's regularized gamma; no scipy needed)."""

from __future__ import annotations

import torch


def chi2_pvalue(counts: dict, expect: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities (cells with tiny expectation pooled)."""
    stat, cells, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for key, p in expect.items():
        e = p * n
        o = counts.get(key, 0)
        if e < 5:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        cells += 1
    df = max(cells - 1, 1)
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
