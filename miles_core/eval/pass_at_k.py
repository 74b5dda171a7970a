"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), computed as a
product so large n does not overflow.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks
