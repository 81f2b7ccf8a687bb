"""Online-softmax steps shared by the attention kernels (flash-attention's running max / sum, in base 2)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
        """Fold one tile of scores s (M, N; log2 units, -inf = masked) and values v (N, D) into (m_i, l_i, acc).

        Rows that have seen no key yet keep m = -inf and contribute nothing (the max is taken as 0 for them).
        """
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def online_softmax_finish(m_i, l_i, acc):
        """Normalised output (M, D) and natural-log log-sum-exp (M,); out 0 and lse -inf for rows with no key."""
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        return out, lse
