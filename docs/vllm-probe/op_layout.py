"""Infer where cpu_attn_reshape_and_cache puts K and V, per isa/dtype, with a scratch cache."""
import torch
import vllm._custom_ops as ops
BS, H = 128, 3
def probe(isa, dtype, D):
    nb = 3
    cache = torch.full((nb, H, BS, 2 * D), -1.0, dtype=dtype)
    view = cache.view(nb, H, 2 * BS, D)
    kc, vc = view.chunk(2, dim=2)
    T = BS + 5
    # value encodes (tok, head, dim) uniquely; small ints exact in bf16 up to 256 only, so use fp32 index map
    tok = torch.arange(T)[:, None, None]; hh = torch.arange(H)[None, :, None]; dd = torch.arange(D)[None, None, :]
    code = (tok * 1000 + hh * 100 + dd).float()
    key = code.to(dtype); value = (code + 0.5).to(dtype)
    slots = torch.tensor([1 * BS + t for t in range(BS)] + [2 * BS + t for t in range(5)])
    try:
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    except Exception as e:
        return f"{isa:6s} {str(dtype):15s} D={D}: ERROR {str(e).splitlines()[0][:150]}"
    # decode: K region of block 1 head 0
    Kreg = view[1, 0, :BS].reshape(-1).float(); Vreg = view[1, 0, BS:].reshape(-1).float()
    exp_K_T = code[:BS, 0, :].T.reshape(-1).to(dtype).float()      # [D, BS]
    exp_K_N = code[:BS, 0, :].reshape(-1).to(dtype).float()        # [BS, D]
    exp_V_N = (code[:BS, 0, :] + 0.5).reshape(-1).to(dtype).float()
    kl = "K^T [D,BS]" if torch.equal(Kreg, exp_K_T) else ("K [BS,D]" if torch.equal(Kreg, exp_K_N) else f"K other: first {Kreg[:6].tolist()}")
    vl = "V [BS,D]" if torch.equal(Vreg, exp_V_N) else f"V other: first {Vreg[:6].tolist()}"
    untouched = bool((view[0].float() == -1).all())
    return f"{isa:6s} {str(dtype):15s} D={D}: {kl}; {vl}; block0 untouched={untouched}"
for isa in ("vec", "vec16", "amx"):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D in (64, 128):
            print(probe(isa, dtype, D))
