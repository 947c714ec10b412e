"""Muon's update: momentum, then the momentum matrix replaced by (approximately) the nearest semi-orthogonal
matrix, computed with a quintic Newton-Schulz iteration.

For a gradient matrix ``G = U S V^T`` the ideal update is ``U V^T`` (every singular value set to one). The
iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` pushes the singular values of a spectrally
normalised ``X`` towards one; the coefficients ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` (Keller Jordan's)
make the slope at zero steep, so five steps suffice, at the price of leaving the singular values spread over
roughly [0.7, 1.2] rather than exactly one (harmless for training).

Two ways to run it (``ns_method``):
- ``standard``: the iteration on the ``n x m`` matrix itself (``n <= m``: the wide orientation);
- ``gram``: every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0 = X_0 X_0^T`` (all of them
  commute), so the loop only multiplies ``n x n`` matrices (``P = a I + b R + c R^2``, ``Q <- P Q``,
  ``R <- P R P``) and touches the wide ``X`` once at the end: fewer FLOPs when ``m >> n``. Products of many ``P``
  lose accuracy in half precision, so the iteration restarts once (``X <- Q X``, ``R`` recomputed) after
  ``GRAM_RESTART`` steps. Square matrices use the standard loop (no saving).

Precision: on a CUDA device the iteration runs in bfloat16 (standard) or float16 (gram, which keeps more
mantissa bits for the Gram products) where the device supports it, as DeepSpeed does; elsewhere (CPU) in
float32, where half precision is slow and buys nothing. ``compute_dtype`` overrides the choice.
"""

from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = frozenset({"standard", "gram"})
NS_STEPS = 5
GRAM_RESTART = 2  # steps before the gram iteration re-anchors X (keeps fp16 products accurate)
_NORM_EPS = 1e-7  # keeps a zero gradient at zero instead of dividing by zero


def check_ns_method(ns_method: str, key: str = "ns_method") -> str:
    if ns_method not in NS_METHODS:
        raise ValueError(f"{key}={ns_method!r}: accepted Newton-Schulz methods are {sorted(NS_METHODS)}")
    return ns_method


def _compute_dtype(t: torch.Tensor, ns_method: str) -> torch.dtype:
    if t.device.type != "cuda":
        return torch.float32
    if ns_method == "gram":
        return torch.float16
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32


def _wide_normalised(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``g`` (``..., n, m``) in ``dtype``, transposed so that ``n <= m``, scaled to Frobenius norm <= 1 (which
    bounds the spectral norm by 1, inside the iteration's basin). Returns it and whether it was transposed."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    return x / (x.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS), tall


def _step_polynomial(r: torch.Tensor) -> torch.Tensor:
    """``a I + b R + c R^2`` for a (batch of) square ``R``."""
    a, b, c = NS_COEFFICIENTS
    p = torch.baddbmm(r, r, r, beta=b, alpha=c) if r.ndim == 3 else torch.addmm(r, r, r, beta=b, alpha=c)
    p.diagonal(dim1=-2, dim2=-1).add_(a)
    return p


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = NS_STEPS,
                                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The orthogonalised ``G`` (``..., n, m``; batched over leading dimensions) by the standard iteration, in the
    compute dtype (see the module docstring)."""
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    x, tall = _wide_normalised(G, compute_dtype or _compute_dtype(G, "standard"))
    for _ in range(steps):
        x = _step_polynomial(x @ x.mT) @ x
    return x.mT if tall else x


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int = NS_STEPS,
                                    compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The orthogonalised ``G`` by the Gram form of the same iteration (equal in exact arithmetic)."""
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    x, tall = _wide_normalised(G, compute_dtype or _compute_dtype(G, "gram"))
    if x.size(-2) == x.size(-1):
        for _ in range(steps):
            x = _step_polynomial(x @ x.mT) @ x
        return x.mT if tall else x
    r = x @ x.mT
    q = None  # the product of the step polynomials since the last anchor (None: the identity)
    for i in range(steps):
        if i == GRAM_RESTART and q is not None:
            x = q @ x
            r, q = x @ x.mT, None
        p = _step_polynomial(r)
        q = p if q is None else p @ q
        if i + 1 < steps and i + 1 != GRAM_RESTART:  # R is needed again and not about to be recomputed
            r = p @ r @ p
    x = x if q is None else q @ x
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, ns_method: str = "gram", steps: int = NS_STEPS,
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    fn = zeropower_via_gram_newtonschulz if ns_method == "gram" else zeropower_via_newtonschulz5
    return fn(update, steps, compute_dtype)


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = NS_STEPS,
                nesterov: bool = True, ns_method: str = "gram", is_expert_group: bool = False,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Muon's update for one weight (returned in ``grad``'s dtype); ``momentum`` is updated in place
    (``m <- beta m + (1 - beta) g``), ``grad`` is left as it is.

    The orthogonalised matrix is ``(1 - beta) g + beta m`` (Nesterov) or ``m``, scaled by
    ``sqrt(max(1, rows / cols))`` so that tall matrices get updates of the same RMS as wide ones. A 4-D
    convolution filter is orthogonalised as ``out_channels x (in * kh * kw)``; an expert group
    (``is_expert_group``: a stacked ``E x n x m`` weight of MoE experts) is orthogonalised per expert.
    """
    check_ns_method(ns_method)
    if grad.shape != momentum.shape:
        raise ValueError(f"muon_update: momentum of shape {tuple(momentum.shape)} does not match the gradient's "
                         f"{tuple(grad.shape)}")
    momentum.lerp_(grad.to(momentum.dtype), 1 - beta)
    update = torch.lerp(grad.to(momentum.dtype), momentum, beta) if nesterov else momentum
    if not is_expert_group and update.ndim == 4:
        update = update.reshape(update.size(0), -1)
    if update.ndim < 2:
        raise ValueError(f"Muon orthogonalises matrices; a parameter of shape {tuple(grad.shape)} must use the "
                         "auxiliary Adam (param.use_muon = False)")
    out = orthogonalize(update, ns_method, ns_steps, compute_dtype)
    out = out * max(1.0, update.size(-2) / update.size(-1)) ** 0.5
    return out.reshape(grad.shape).to(grad.dtype)


def adam_update(grad: torch.Tensor, buf1: torch.Tensor, buf2: torch.Tensor, step: int,
                betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)``; updates the moments in place."""
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    m_hat = buf1 / (1 - betas[0] ** step)
    v_hat = buf2 / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)
