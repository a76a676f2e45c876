"""
What a generation carries from step to step: per layer the KV cache and, in MoE layers whose
router has an online rule, the Expert Cache (Eq. 6: the router scores of the tokens so far, for
online SeqTopK). The KV cache is static, as in gpt-fast: buffers of block_size tokens written in
place at a position counted on the device, kept when a Cache is reused. The Expert Cache grows by
one row per token, as Eq. 6 writes it (fast.StaticCache keeps it in a buffer too, for a compiled
decoding step).
"""
import torch


class Cache:

    def __init__(self, config):
        self.block_size = config.block_size
        self.pos = None  # (1,), on the device: how many tokens the caches hold
        self.layers = [self.new_layer() for _ in range(config.n_layer)]

    def positions(self, T, device):
        """The positions of the next T tokens (T,)."""
        if self.pos is None:
            self.pos = static(torch.zeros(1, dtype=torch.long, device=device))
        return self.pos + torch.arange(T, device=device)

    def new_layer(self):  # fast.StaticCache: a layer with a static Expert Cache
        return LayerCache(self)

    def advance(self, T):  # after the T new tokens went through every layer
        self.pos.add_(T)

    def reset(self):  # empty again (the context starting again), keeping the KV buffers
        for layer in self.layers:
            layer.reset()
        if self.pos is not None:
            self.pos.zero_()


def static(buffer):
    """A buffer a compiled step updates in place: its address stays (CUDA graphs need it)."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


class LayerCache:
    """One layer's part, the KV buffers allocated at their first write (again for another
    batch)."""

    def __init__(self, cache):
        self.cache = cache
        self.k = self.v = None     # (B, n_head, block_size, head size)
        self.expert_cache = None   # (B, tokens so far, R): each token's scores still competing
        self.spent = None          # (B,): the experts those tokens took

    def write_kv(self, k, v, pos):
        """New keys and values (B, n_head, T, head size) at pos (T,); the whole buffers."""
        if self.k is None or self.k.shape[0] != k.shape[0] or self.k.dtype != k.dtype:
            B, n_head, _, head_size = k.shape
            self.k, self.v = (static(t.new_zeros(B, n_head, self.cache.block_size, head_size))
                              for t in (k, v))
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v

    def expert_past(self):
        """What the router reads: the Expert Cache of the tokens so far (B, P, R) and the
        experts they took (B,); None, None before the first."""
        return self.expert_cache, self.spent

    def append_experts(self, rows, mask):
        """Eq. (6) after the new tokens: rows, the Expert Cache the online rule joined for
        them (B, P + T, R), kept as it is (or their rows alone (B, T, R), joined here), and
        the experts their mask (B, T, N) gives them."""
        if self.expert_cache is not None and rows.shape[1] == mask.shape[1]:
            rows = torch.cat([self.expert_cache, rows], dim=1)
        taken = mask.sum(dim=(1, 2))  # (B,)
        self.expert_cache = rows
        self.spent = taken if self.spent is None else self.spent + taken

    def reset(self):
        self.expert_cache = self.spent = None
