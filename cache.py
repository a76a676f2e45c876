"""
What a generation carries from step to step: per layer the KV cache and, in MoE layers, the
Expert Cache (Eq. 6: the router scores of the tokens so far, for online SeqTopK). Static, as in
gpt-fast: buffers of block_size tokens written in place at a position counted on the device
(one graph), kept when a Cache is reused.
"""
import torch


class Cache:

    def __init__(self, config):
        self.block_size = config.block_size
        self.pos = None  # (1,), on the device: how many tokens the caches hold
        self.layers = [LayerCache(self) for _ in range(config.n_layer)]

    def positions(self, T, device):
        """The positions of the next T tokens (T,); GPT.forward advances pos after the layers."""
        if self.pos is None:
            self.pos = static(torch.zeros(1, dtype=torch.long, device=device))
        return self.pos + torch.arange(T, device=device)

    def reset(self):  # empty again (the context starting again), keeping the buffers
        for layer in self.layers:
            if layer.expert_cache is not None:
                layer.expert_cache.fill_(float('-inf'))
                layer.spent.zero_()
        if self.pos is not None:
            self.pos.zero_()


def static(buffer):
    """A buffer a compiled step updates in place: its address stays (CUDA graphs need it)."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


class LayerCache:
    """One layer's part, each buffer allocated at its first write (again for another batch)."""

    def __init__(self, cache):
        self.cache = cache
        self.k = self.v = None     # (B, n_head, block_size, head size)
        self.expert_cache = None   # (B, block_size, R): each token's scores still competing
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

    def n_past(self):  # the tokens the Expert Cache holds before this call's
        return self.cache.pos

    def expert_cache_so_far(self):
        """Its rows of the tokens so far (B, P, R), the experts they took (B,); or None, None."""
        if self.expert_cache is None:
            return None, None
        return self.expert_cache[:, :int(self.n_past())], self.spent

    def write_expert_cache(self, rows, taken):
        """The new tokens' rows (B, T, R) after the earlier ones' (the slots past them
        stay -inf, below any score), and the experts they took (B,)."""
        if self.expert_cache is None or self.expert_cache.shape[0] != rows.shape[0]:
            B, _, R = rows.shape
            empty = rows.new_full((B, self.cache.block_size, R), float('-inf'))
            self.expert_cache, self.spent = static(empty), static(taken.new_zeros(B))
        pos = self.cache.pos + torch.arange(rows.shape[1], device=rows.device)
        self.expert_cache.index_copy_(1, pos, rows)
        self.spent.add_(taken)
