"""The loss through the head a chunk of tokens at a time: cross_entropy(x·Wᵀ, targets), no full logits.

Each chunk forms its logits, their log-softmax and, while they are at hand, the gradients of the
mean loss with respect to x and W (softmax minus one-hot, over the number of targets); the backward
only scales those by its incoming gradient. So the head's three matmuls run once each, as without
chunks (nothing is recomputed), and what lives from the forward to the backward is dX (tokens x C)
and dW (V x C, fp32) instead of tokens x V logits, their log-softmax and, later, their gradients. On a
CPU it is also the faster loss: glibc maps every allocation over 32 MB afresh, so full logits are new
pages faulted in at each step, four times (bench/RESULTS.md, "The CPU run").
"""
import torch


def linear_cross_entropy(x, weight, targets, chunk):
    """x (..., C), weight (V, C), targets (...) with -1 for none -> the mean loss over the targets."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)   # (N, C), (N,)
    device = x.device.type
    # under autocast the matmuls run in its dtype, as F.linear would; the softmax always in fp32
    dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, chunk, dt)
    return _chunks(x, weight, targets, chunk, dt, False, False)[0]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, chunk, dt):
        loss, dx, dw = _chunks(x, weight, targets, chunk, dt, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        return (None if dx is None else dx * grad.to(dx.dtype),
                None if dw is None else (dw * grad).to(ctx.weight_dtype), None, None, None)


def _chunks(x, weight, targets, chunk, dt, want_dx, want_dw):
    """-> (mean loss, dX or None, dW in fp32 or float64, or None): the gradients of the mean loss."""
    with torch.autocast(x.device.type, enabled=False):
        count = (targets != -1).sum()        # the mean's divisor, as F.cross_entropy's ignore_index=-1
        acc = torch.promote_types(dt, torch.float32)   # the softmax's and dW's dtype: fp32 at least
        w = weight.to(dt)
        loss = x.new_zeros((), dtype=acc)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros_like(weight, dtype=acc) if want_dw else None
        for i in range(0, x.size(0), chunk):
            xc, tc = x[i:i + chunk].to(dt), targets[i:i + chunk]            # (n, C), (n,)
            t = tc.clamp(min=0)[:, None]
            share = ((tc != -1).to(acc) / count)[:, None]                   # (n, 1): 1/count, 0 for none
            logp = torch.log_softmax((xc @ w.t()).to(acc), dim=1)           # (n, V)
            loss -= (logp.gather(1, t) * share).sum()
            if not (want_dx or want_dw):
                continue
            # softmax minus one-hot; each row's share applied to the thin (n, C) operands, not to it
            g = logp.exp_().scatter_add_(1, t, logp.new_full(t.shape, -1.0)).to(dt)
            if want_dx:
                dx[i:i + chunk] = (g @ w).mul_(share)
            if want_dw:   # accumulated in fp32 (at least) over the chunks, whatever dt
                xs = (xc * share).to(dt)
                dw.addmm_(g.t(), xs) if dt == acc else dw.add_(g.t() @ xs)
        return loss, dx, dw
