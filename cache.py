"""
What a generation carries from step to step: the KV cache and the Expert Cache, in static buffers.
model.GPT.forward and router.py write them; generate passes one Cache through every step.
"""
import torch


class Cache:
    """What one generation carries from step to step, per layer: the attention keys and values (the KV
    cache) and, in the MoE layers, every token's router scores that online SeqTopK can still weigh, of
    rank seq_min_k..seq_max_k-1 (the Expert Cache), and the experts spent. Static, as in gpt-fast: each
    buffer holds block_size tokens from its first write on and is written in place at the current
    position, a tensor, so a decoding step's shapes never depend on the context and the step can be
    compiled to one graph. Passed through forward(); the model itself holds no decoding state."""

    def __init__(self, config):
        self.block_size = config.block_size
        self.length = 0   # tokens written, counted on the host: reserve() checks them against block_size
        self.pos = None   # the same on the device, where a (compiled) step reads and advances it
        self.layers = [LayerCache(self) for _ in range(config.n_layer)]

    def reserve(self, T):
        """Room for T more tokens, counted on the host; a compiled step leaves this to its caller."""
        if self.length + T > self.block_size:
            raise ValueError(f"sequence of length {self.length + T} is longer than block_size={self.block_size}")
        self.length += T

    def positions(self, T, device):
        """The positions of the next T tokens, on the device (reserving them, unless compiling)."""
        if not torch.compiler.is_compiling():
            self.reserve(T)
        if self.pos is None:
            self.pos = static(torch.zeros(1, dtype=torch.long, device=device))
        return self.pos + torch.arange(T, device=device)

    def reset(self):
        """Empty again (generation past block_size starts over), keeping the buffers: nothing recompiles."""
        self.length = 0
        for buffer in [self.pos] + [layer.count for layer in self.layers]:
            if buffer is not None:
                buffer.zero_()
        for layer in self.layers:
            if layer.candidates is not None:
                layer.candidates.fill_(float('-inf'))

    def nbytes(self, kind):
        """Bytes held by the KV cache ('kv') or by the Expert Cache ('expert')."""
        names = ('k', 'v') if kind == 'kv' else ('candidates', 'count', 'spent')
        return sum(t.numel() * t.element_size() for layer in self.layers for t in map(layer.__dict__.get, names)
                   if t is not None)


def static(buffer):
    """A cache buffer that a compiled step updates in place: its address stays (CUDA graphs need that)."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


class LayerCache:
    """One layer's part of a Cache, each buffer allocated for block_size tokens at its first write."""

    def __init__(self, cache):
        self.cache = cache  # the whole Cache, whose host count an eager step reads
        self.block_size = cache.block_size
        self.k = self.v = None   # (B, n_head, block_size, head size): keys and values, head by head as attention reads them
        self.candidates = None   # (B, block_size, R): each token's candidate scores, -inf where no token is yet
        self.count = None        # (1,): the tokens in the Expert Cache
        self.spent = None        # (B,): the experts they took

    def write_kv(self, k, v, pos):
        """This call's keys and values at their positions; returns the buffers up to the last position written."""
        if self.k is None:
            self.k, self.v = (static(t.new_zeros(*t.shape[:2], self.block_size, t.shape[3])) for t in (k, v))
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.written(self.k, 2), self.written(self.v, 2)

    def past_scores(self, T):
        """The Expert Cache before this call's T tokens (None before its first write)."""
        return None if self.candidates is None else self.written(self.candidates, 1, unwritten=T)

    def written(self, buffer, dim, unwritten=0):
        # eagerly only the positions written so far (the host's count, less those not yet written); a compiled
        # step reads the whole static buffer, whose unused rest its reader masks (attention) or never counts
        # (-inf), and never reads the host's count, which would make the graph depend on it (a recompile)
        return buffer if torch.compiler.is_compiling() else buffer.narrow(dim, 0, self.cache.length - unwritten)

    def write_scores(self, candidates, spent):
        """The Expert Cache: the new tokens' candidate scores after the earlier ones', and the experts spent."""
        if self.candidates is None:
            B, _, R = candidates.shape
            self.candidates = static(candidates.new_full((B, self.block_size, R), float('-inf')))
            self.count = static(torch.zeros(1, dtype=torch.long, device=candidates.device))
            self.spent = static(spent.new_zeros(B))
        self.candidates.index_copy_(1, self.count + torch.arange(candidates.shape[1], device=candidates.device),
                                    candidates)
        self.count.add_(candidates.shape[1])
        self.spent.copy_(spent)
