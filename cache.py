"""
What a generation carries from step to step, per layer: the KV cache, static as in gpt-fast
(buffers of block_size tokens written in place at a position counted on the device), and
where the router has an online rule the Expert Cache (Eq. 6), a row a token.
"""
import torch


class Cache:

    def __init__(self, config):
        self.block_size = config.block_size
        self.pos = None  # (1,), on the device: how many tokens the caches hold
        self.layers = [self.new_layer() for _ in range(config.n_layer)]

    def positions(self, T, device):  # the next T tokens' (T,)
        if self.pos is None:
            self.pos = static(torch.zeros(1, dtype=torch.long, device=device))
        return self.pos + torch.arange(T, device=device)

    def new_layer(self):  # sample.StaticCache: a layer with a static Expert Cache
        return LayerCache(self)

    def advance(self, T):  # after the T new tokens went through every layer
        self.pos.add_(T)

    def reset(self):  # empty again (the context starting again), keeping the KV buffers
        for layer in self.layers:
            layer.reset()
        if self.pos is not None:
            self.pos.zero_()


def static(buffer):
    """A buffer a compiled step updates in place: its address stays (for CUDA graphs)."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


class LayerCache:
    """A layer's part, its KV buffers made at their first write (again for a new batch)."""

    def __init__(self, cache):
        self.cache = cache
        self.k = self.v = None     # (B, n_head, block_size, head size)
        self.expert_cache = None   # (B, tokens so far, R): their scores still competing
        self.spent = None          # (B,): the experts those tokens took

    def write_kv(self, k, v, pos):
        """New keys and values (B, n_head, T, head size) at pos (T,); the buffers."""
        if self.k is None or self.k.shape[0] != k.shape[0] or self.k.dtype != k.dtype:
            shape = (*k.shape[:2], self.cache.block_size, k.shape[3])  # (B, nh, T_max, hs)
            self.k, self.v = (static(t.new_zeros(shape)) for t in (k, v))
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v

    def expert_past(self):
        """The Expert Cache of the tokens so far (B, P, R), the experts they took (B,)."""
        return self.expert_cache, self.spent

    def append_experts(self, S, mask):
        """Eq. (6) after T new tokens: S (B, P + T, R), the Expert Cache the rule joined,
        kept (their rows alone (B, T, R): joined here); the experts their mask took."""
        if self.expert_cache is not None and S.shape[1] == mask.shape[1]:
            S = torch.cat([self.expert_cache, S], dim=1)
        self.expert_cache, taken = S, mask.sum(dim=(1, 2))  # taken (B,)
        self.spent = taken if self.spent is None else self.spent + taken

    def reset(self):
        self.expert_cache = self.spent = None
