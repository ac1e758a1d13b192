#!/usr/bin/env python3
"""Write the inputs of kernels/cachegen_devcheck.cu: a CPU-encoded bf16 chunk
[2, 30, 256, 192] of synthetic KV (chunk.bin) and its CPU decode (decoded.raw).

    python kernels/devcheck_inputs.py OUT_DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvtool.codecs.cachegen import cachegen_decode, cachegen_encode  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((2, 30, 256, 192), generator=g)
    kv[0] *= 2.2
    kv[0, :, :, ::50] *= 4
    kv[1] *= 0.9
    kv = kv.to(torch.bfloat16)
    payload, params = cachegen_encode(kv, None, impl="native")
    dec = cachegen_decode(payload, kv.shape, kv.dtype, params, impl="native")
    with open(os.path.join(out, "chunk.bin"), "wb") as f:
        f.write(payload)
    dec.view(torch.int16).numpy().tofile(os.path.join(out, "decoded.raw"))
    print(f"wrote {len(payload)} payload bytes and {dec.numel() * 2} decoded bytes to {out}")


if __name__ == "__main__":
    main()
