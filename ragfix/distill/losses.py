"""The losses of Pos2Distill (arXiv 2508.15709, section 3.2 and official ``kd/loss_design.py``).

R1 (retrieval) distils the model's answer distribution at the advantaged position into every other
position with a token-level KL, weighted per row by :func:`position_weights`; the batch loss is
``sum_b w_b * KL_b`` (the paper's ``L_Act + lambda * L_Anc``). R2 (reasoning) trains the teacher's
chain of thought with cross-entropy (token mean per row, mean over the effective batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_kl(
    teacher_logp: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Token-level KL(teacher || student) averaged over each sample's answer tokens (section 3.2,
    the activation and anchoring terms).

    Args:
        teacher_logp: float ``[B, L, V]`` teacher log-probabilities.
        student_logits: float ``[B, L, V]`` student logits (log-softmax is applied here).
        mask: bool ``[B, L]``, the answer tokens.

    Returns:
        float32 ``[B]``: ``KL_b = mean_t sum_v p_T (log p_T - log p_S)`` (nats).
    """
    logp_s = torch.log_softmax(student_logits.float(), dim=-1)
    tok = (teacher_logp.exp() * (teacher_logp - logp_s)).sum(-1)
    m = mask.float()
    return (tok * m).sum(-1) / m.sum(-1).clamp(min=1)


def per_sample_ce(
    student_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of the target tokens averaged over each sample's answer tokens (R2, the
    reasoning variant's supervised loss on the teacher's chain of thought).

    Args:
        student_logits: float ``[B, L, V]``. targets: int64 ``[B, L]``. mask: bool ``[B, L]``.

    Returns:
        float32 ``[B]`` (nats per token).
    """
    ce = F.cross_entropy(student_logits.float().transpose(1, 2), targets, reduction="none")
    m = mask.float()
    return (ce * m).sum(-1) / m.sum(-1).clamp(min=1)


def position_weights(
    kl: torch.Tensor, positions: torch.Tensor, anchor: torch.Tensor, anchor_weight: float = 1.0
) -> torch.Tensor:
    """Position-aware weights of Pos2Distill over one effective batch (section 3.2, detached).

    Args:
        kl: float ``[N]`` per-sample KL of the whole effective batch (all processes).
        positions: int ``[N]`` gold position of each sample.
        anchor: bool ``[N]``, anchoring samples (weight ``anchor_weight``, the paper's lambda).
        anchor_weight: lambda.

    Returns:
        float32 ``[N]``: for a trivial sample at position ``i``,
        ``softmax_i(m_i) * P / n_i * KL_b / max_{b' at i} KL_b'`` with ``m_i`` the mean KL at ``i``,
        ``n_i`` the count and ``P`` the number of distinct trivial positions in the batch
        (official code, ``kd/loss_design.py``; the paper's alpha_ij without the ``P / n_i``).
        A position whose KLs are all zero gets weight 0.
    """
    kl = kl.detach().float()
    w = torch.zeros_like(kl)
    w[anchor] = anchor_weight
    trivial = ~anchor
    if trivial.any():
        uniq = torch.unique(positions[trivial])
        means = torch.stack([kl[trivial & (positions == p)].mean() for p in uniq])
        c = torch.softmax(means, dim=0) * len(uniq)
        for p, ci in zip(uniq, c, strict=True):
            sel = trivial & (positions == p)
            top = kl[sel].max()
            if top > 0:
                w[sel] = ci / sel.sum() * kl[sel] / top
    return w


__all__ = ["per_sample_ce", "per_sample_kl", "position_weights"]
