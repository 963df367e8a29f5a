"""The kernel calls of the torch attention backend (:mod:`megascore.model.attention`): one
batch of query chunks against their keys, on the CPU and on CUDA.

* :func:`chunk_attention`: a bucket's plain call, ``F.scaled_dot_product_attention``
  causal or under a bool mask (a context-parallel chunk: query ``i`` sees keys
  ``0 .. offset + i``), GQA through ``enable_gqa``. On CUDA torch's flash attention takes
  no mask and no float32, and its memory-efficient attention takes both but not GQA
  (``can_use_mem_efficient_attention``: ``check_batch_size_and_num_heads_dense<false>``),
  so a masked or float32 GQA call with ``enable_gqa`` fell to the math kernel (``[n,
  heads, q, k]`` float32 scores). There the K/V heads are expanded to the query heads
  first (:func:`cuda_expands_groups`), which the memory-efficient kernel takes. The CPU
  keeps ``enable_gqa`` (the same call as before, bitwise the same numbers).
* :func:`attention_with_lse`: the shared-prefix path's call, which keeps the
  log-sum-exp; :func:`merge` joins two of them over disjoint keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def expand_groups(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """K / V ``[n, groups, k_len, dim]`` with each group repeated for its query heads:
    ``[n, heads, k_len, dim]`` (query head ``h`` reads group ``h // (heads / groups)``, as
    ``enable_gqa`` does)."""
    if k.shape[1] == heads:
        return k, v
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def cuda_expands_groups(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`chunk_attention` expands the K/V heads: a GQA call on CUDA that
    flash attention cannot take (a mask, or not half precision)."""
    gqa = k.shape[1] != q.shape[1]
    flash = mask is None and q.dtype in _FLASH_DTYPES
    return gqa and q.device.type == "cuda" and not flash


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention of a batch of query chunks (module docstring).

    Args:
        q: ``[n, heads, q_len, dim]``.
        k: ``[n, groups, k_len, dim]`` (``heads`` a multiple of ``groups``).
        v: ``[n, groups, k_len, v_dim]``.
        causal: query ``i`` sees keys ``0 .. i``.
        mask: bool ``[q_len, k_len]`` (True: attend) or None.
        scale: the softmax scale.
        dropout_p: attention dropout.

    Returns:
        ``[n, heads, q_len, v_dim]``.
    """
    if cuda_expands_groups(q, k, mask):
        k, v = expand_groups(k, v, q.shape[1])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of each query's scores, on any device: the
    shared-prefix path's one kernel call (torch's flash attention on the CPU, its
    memory-efficient attention on CUDA, which takes float32 as well).

    Args:
        q: ``[n, heads, q_len, dim]``.
        k: ``[n, groups, k_len, dim]`` (GQA: ``heads`` a multiple of ``groups``).
        v: ``[n, groups, k_len, v_dim]``.
        causal: query ``i`` sees keys ``0 .. i``.
        mask: bool ``[q_len, k_len]`` (True: attend) or None.
        scale: the softmax scale.

    Returns:
        ``(out [n, heads, q_len, v_dim], lse float32 [n, heads, q_len])``.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    cuda = q.device.type == "cuda"
    bias = None
    if mask is not None:  # additive; on CUDA its rows padded to 16 keys (aligned)
        padded = -(-k_len // 16) * 16 if cuda else k_len
        bias = q.new_zeros(q_len, padded)[:, :k_len].masked_fill_(~mask, float("-inf"))
    if not cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    k, v = expand_groups(k, v, q.shape[1])
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q_len, k_len)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., :q_len].float()


def merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Two softmax attentions of the same queries over disjoint keys, as one over both:
    ``out`` ``[n, heads, v_dim]``, ``lse`` float32 ``[n, heads]``."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = (lse_a - top).exp()[..., None], (lse_b - top).exp()[..., None]
    return (out_a.float() * wa + out_b.float() * wb) / (wa + wb)


def merge_ordered(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """:func:`merge` whose every row's bits depend on that row alone: the two weights are
    one softmax over the pair (a per-row kernel), not an elementwise ``exp`` over the
    tensor (whose vectorised loop leaves each thread's last elements to a scalar ``exp``,
    so a row's bits would depend on the tensor's size: ``megascore.model.batch_invariant``).
    ``out`` ``[..., v_dim]``, ``lse`` float32 ``[...]``; ``a`` is always the keys before."""
    weights = torch.softmax(torch.stack([lse_a, lse_b], -1), -1)  # [..., 2]
    return out_a.float() * weights[..., :1] + out_b.float() * weights[..., 1:]
