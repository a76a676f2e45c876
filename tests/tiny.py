"""
A tiny model and a learnable toy language to train it on, for the tests (conftest gives them too).
"""
import os
import runpy

import torch

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'config',
                    'tiny.py')


def random_scores(B, T, N, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 3, (B, T, N), generator=g).float() if ties
              else torch.randn(B, T, N, generator=g))
    return logits.softmax(-1)


def tiny_config(router, **kw):
    """config/tiny.py's model on a 16-token vocabulary (the counting language's)."""
    from model import GPTConfig  # here, not above: forked.py's forks import the model afresh
    shape = {k: v for k, v in runpy.run_path(TINY).items() if k in GPTConfig.__dataclass_fields__}
    return GPTConfig(router=router, **{**shape, 'vocab_size': 16, **kw})


def counting_batches(seed=0, B=8, T=32):
    """A learnable language: counting upward mod 16 from a random start."""
    g = torch.Generator().manual_seed(seed)
    while True:
        seq = (torch.randint(0, 16, (B, 1), generator=g) + torch.arange(T + 1)) % 16
        yield seq[:, :-1], seq[:, 1:]


def train_tiny(model, steps, lr=3e-3, check=None):
    from router import step_ks
    opt = model.configure_optimizers(0.0, lr, (0.9, 0.99), 'cpu')
    losses = []
    for _, (x, y) in zip(range(steps), counting_batches()):
        _, ce, aux = model(x, y, moe_ks=step_ks(model.config, len(model.routers())))
        (ce + aux['aux_loss']).backward()
        opt.step()
        opt.zero_grad()
        # the routers' step rule, once per step (relu's lambda; a no-op for most)
        model.after_step()
        losses.append(ce.item())
        if check:
            check(aux['routing'])
    return losses


def trained_tiny(router, **kw):
    from model import GPT
    torch.manual_seed(0)
    model = GPT(tiny_config(router, **kw))
    train_tiny(model, 10)
    return model.eval()


def train_step(model, x, y, moe_ks=None):
    """Loss and gradients of one training step (forward + backward)."""
    model.zero_grad()
    _, ce, aux = model(x, y, moe_ks=moe_ks)
    (ce + aux['aux_loss']).backward()
    return ce.detach(), [p.grad.clone() for p in model.parameters()]
