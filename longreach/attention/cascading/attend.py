"""How a cascading stride attends, as plain functions (backend.py calls them): the RoPE tables
that undo the model's rotation, and the gathered prefill path — a stride's virtual sequence copied contiguous with its
keys rotated once (`gather_virtual`), then attention over it with FlashAttention, which also returns the log-sum-exp
the key mass needs (`causal_attention_lse`). docs/sparse.md ("Cascading KV cache", design step 3) has the reasons and
the H100 numbers."""
from __future__ import annotations

import torch

from ...rope.strategies import rotate_cs


def unrotation(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables that undo the model's RoPE (rope/scaling.py: apply_rope) at positions pos (T,) with `rotate_cs`:
    the same fp32 angles, transposed, so the result is exact whatever the position (1M included). (T, 1, D/2)."""
    ang = pos.float()[:, None] * inv_freq[None, :]  # (T, D/2), as the model computed it
    return ang.cos()[:, None, :], -ang.sin()[:, None, :]


def gather_virtual(kf: torch.Tensor, vf: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   chunk: int = 32768) -> tuple[torch.Tensor, torch.Tensor]:
    """A virtual sequence's keys, rotated at their virtual positions, and values: (V, H_kv, D) each, in the cache's
    dtype. kf/vf (slots, H_kv, D) the flat cache (keys un-rotated); slots (V,) its flat slots in virtual order;
    cos/sin (>= V, D/2) the rotation tables of positions 0, 1, ... (`rotation`). RoPE strategy "cache" done once per
    stride and layer, instead of in every query block's program of the block-sparse kernel. The fp32 rotation runs
    `chunk` keys at a time, so its temporaries stay ~chunk x H_kv x D x 16 bytes whatever V."""
    idx = slots.long()
    V = idx.shape[0]
    k = torch.empty((V,) + tuple(kf.shape[1:]), dtype=kf.dtype, device=kf.device)
    for a in range(0, V, chunk):
        b = min(V, a + chunk)
        k[a:b] = rotate_cs(kf[idx[a:b]], cos[a:b, None, :], sin[a:b, None, :])
    return k, vf[idx]


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a stride's n query rows over its virtual sequence: q (n, H_q, D), k/v (V, H_kv, D), V >= n; row i
    sees keys [0, V - n + i] (causal, aligned at the bottom right). -> out (n, H_q, D) in q's dtype, lse (n, H_q) fp32
    (natural log of the scaled scores' exp-sum, as the block-sparse kernel's).

    kernel "flash": PyTorch's FlashAttention-2 op (CUDA, fp16/bf16, head_dim a multiple of 8), whose `is_causal`
    aligns at the bottom right when the lengths differ (torch.nn.attention.bias.causal_lower_right dispatches to it
    the same way) and which returns the log-sum-exp; the public SDPA returns none. kernel "reference": the explicit
    softmax in fp32 (tests). Grouped query heads: KV head h // (H_q / H_kv) serves query head h."""
    n, Hq, _ = q.shape
    V, Hkv = k.shape[0], k.shape[1]
    if V < n:
        raise ValueError(f"a stride of {n} rows needs at least {n} keys, got {V}")
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))  # (1, H, L, D) views
    if kernel == "flash":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)[:2]
    elif kernel == "reference":
        s = (qt.float() @ kt.float().transpose(-1, -2)) * scale
        allowed = torch.ones(n, V, dtype=torch.bool, device=q.device).tril(V - n)
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        o = (torch.exp(s - lse[..., None]) @ vt.float()).to(q.dtype)
    else:
        raise ValueError(f"kernel must be 'flash' or 'reference', got {kernel!r}")
    return o[0].transpose(0, 1), lse[0].transpose(0, 1).contiguous()
