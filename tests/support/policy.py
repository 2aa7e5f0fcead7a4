"""What the policy tests share: a one-layer layout and blocks whose bytes name their key."""

from __future__ import annotations

import torch

from kvstore import KVLayout

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)
BN = LAY.block_nbytes


def kv_for(keys):
    """Blocks for ``keys``, each filled with its key's first two bytes."""
    out = torch.empty(LAY.batch_shape(len(keys)), dtype=torch.int16)
    for i, k in enumerate(keys):
        out[i] = int.from_bytes(k[:2], "little") - 2**15
    return out.view(torch.float16)
