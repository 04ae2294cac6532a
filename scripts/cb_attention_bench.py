"""One layer of ``paged|hopper_flash`` (transformers' continuous batching) on
a decode step, timed two ways on the same cache: the keys read in place
through a block table (``paged_cache_view``, shipped) and read back packed by
``cache.update`` first (the route before the fifty-eighth session, and still
that of sliding-window layers). The cache stands in for transformers'
``PagedAttentionCache``: pools ``[pages, heads_kv, head_dim]``, blocks of
``block_size`` pages dealt to the requests at random, the read and write
indices its full attention allocator makes, and its ``update`` (write the new
keys, then ``index_select`` every request's keys).

    PYTHONPATH=. python scripts/cb_attention_bench.py      (on the GPU)
"""
import random

import torch
import triton

import hopper_flash
from hopper_flash.integrations import transformers as hft


class Cache:
    def __init__(self, num_blocks, block_size, heads_kv, dim):
        self.block_size = block_size
        self.layer_index_to_group_indices = {0: (0, 0)}
        self.sliding_windows = {0: 1}
        shape = (num_blocks * block_size, heads_kv, dim)
        self.key_cache = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)]
        self.value_cache = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)]

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        k = key_states.transpose(1, 2).squeeze(0)
        v = value_states.transpose(1, 2).squeeze(0)
        self.key_cache[0].index_copy_(0, write_index[0], k)
        self.value_cache[0].index_copy_(0, write_index[0], v)
        if read_index[0].numel() == 0:
            return k, v
        return self.key_cache[0].index_select(0, read_index[0]), self.value_cache[0].index_select(0, read_index[0])


def step(past, new, heads=32, heads_kv=8, dim=128, block_size=256):
    """A step's attention arguments: request b has past[b] cached keys and new[b] new tokens."""
    blocks_each = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    cache = Cache(sum(blocks_each) + 4, block_size, heads_kv, dim)
    order = list(range(sum(blocks_each)))
    random.Random(0).shuffle(order)
    read, write, at = [], [], 0
    for p, n, nb in zip(past, new, blocks_each):
        blocks, at = order[at:at + nb], at + nb
        place = [blocks[j // block_size] * block_size + j % block_size for j in range(p + n)]
        read += place
        write += place[p:]
    dev = dict(device="cuda")
    total_q = sum(new)
    cu_q = torch.tensor([0] + new, **dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [p + n for p, n in zip(past, new)], **dev).cumsum(0).to(torch.int32)
    q = torch.randn(1, heads, total_q, dim, **dev, dtype=torch.bfloat16)
    k = torch.randn(1, heads_kv, total_q, dim, **dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    module = torch.nn.Module()
    module.layer_idx, module.is_causal = 0, True
    kwargs = dict(cache=cache, read_index=[torch.tensor(read, **dev)], write_index=[torch.tensor(write, **dev)],
                  cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_seqlen_q=max(new),
                  max_seqlen_k=max(p + n for p, n in zip(past, new)))
    return module, q, k, v, kwargs, sum(p + n for p, n in zip(past, new))


def main():
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          "H32/8 D128 bf16, block size 256")
    in_place = hft.paged_cache_view
    rows = [("64 decodes over 4096 keys", [4096] * 64, [1] * 64),
            ("32 decodes over 16384 keys", [16384] * 32, [1] * 32),
            ("8 decodes over 32768 keys", [32768] * 8, [1] * 8),
            ("63 decodes over 1024 keys + 1 over 65536", [1024] * 63 + [65536], [1] * 64),
            ("64 decodes over 1024-8192 keys + a 512-token chunk", [random.Random(1).randint(1024, 8192)
                                                                   for _ in range(64)] + [2048], [1] * 64 + [512])]
    for name, past, new in rows:
        module, q, k, v, kwargs, keys = step(past, new)
        times = {}
        for route, view in (("in place", in_place), ("read back packed", lambda *a: None)):
            hft.paged_cache_view = view
            fn = lambda: hft.hopper_flash_paged_attention_forward(module, q, k, v, None, scaling=None, **kwargs)  # noqa: E731
            out = fn()[0].clone()
            times[route] = (triton.testing.do_bench(fn, warmup=25, rep=200), out)
        hft.paged_cache_view = in_place
        (t_in, o_in), (t_back, o_back) = times["in place"], times["read back packed"]
        tbs = keys * 8 * 128 * 2 * 2 / (t_in * 1e-3) / 1e12
        print(f"{name}: in place {t_in * 1e3:.1f} us ({tbs:.2f} TB/s of K/V), read back packed "
              f"{t_back * 1e3:.1f} us: {t_back / t_in:.2f}x; outputs differ by at most "
              f"{(o_in.float() - o_back.float()).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
