"""Make a random-weight model in the shape of a real one, for timing on a GPU machine without
network: a Hugging Face folder (config.json, sharded bf16 safetensors, a tokenizer) that
`kvtool capture/replay --model DIR` load like any other, and a prompt of exactly N tokens.

    python scripts/gpu_random_model.py /tmp/llama8b --tokenizer DIR_WITH_tokenizer.json --tokens 8000

The shape is Llama-3-8B's (32 layers, 32 query heads, 8 KV heads of 128, hidden 4096, MLP
14336, vocabulary 128256): the KV cache and the prefill cost are an 8B model's; the text it
writes is noise. Weights are drawn on the GPU (std 0.02, norms 1) and written in ~2 GB shards.
The tokenizer is any tokenizer.json whose ids fit the vocabulary (the default model's does).
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-family checkpoint, by its Hugging Face name."""
    e, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], e), "model.norm.weight": (e,),
           "lm_head.weight": (cfg["vocab_size"], e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (q, e), p + "self_attn.k_proj.weight": (kv, e),
                p + "self_attn.v_proj.weight": (kv, e), p + "self_attn.o_proj.weight": (e, q),
                p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
                p + "mlp.down_proj.weight": (e, f), p + "input_layernorm.weight": (e,),
                p + "post_attention_layernorm.weight": (e,)}
    return out


def write_weights(folder: Path, cfg: dict, device: str, shard_bytes: int = 2 << 30) -> int:
    generator = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)
        shard, size = {}, 0

    for name, shape in shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02)
            t = t.to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def prompt_of(tokenizer_json: Path, tokens: int) -> str:
    """Python's own library source, cut at exactly `tokens` tokens."""
    from tokenizers import Tokenizer

    import asyncio, collections, dataclasses, email, json as json_module, logging, pathlib, typing  # noqa: E401
    text = "".join(inspect.getsource(m) for m in (asyncio.base_events, collections, dataclasses, logging,
                                                   pathlib, typing, json_module.decoder, email.message,
                                                   inspect))
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) < tokens:
        raise SystemExit(f"only {len(ids)} tokens of text at hand, {tokens} asked")
    return tok.decode(ids[:tokens])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder holding tokenizer.json")
    ap.add_argument("--tokens", type=int, default=8000, help="the prompt's length (written to FOLDER/prompt.txt)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than Llama-3-8B's 32")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(LLAMA3_8B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    args.folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    total = write_weights(args.folder, cfg, device)
    (args.folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (args.tokenizer / name).is_file():
            shutil.copy(args.tokenizer / name, args.folder / name)
    prompt = prompt_of(args.folder / "tokenizer.json", args.tokens)
    (args.folder / "prompt.txt").write_text(prompt)
    print(f"{args.folder}: {total / 1e9:.1f} GB of bf16 weights, {cfg['num_hidden_layers']} layers; "
          f"prompt.txt: {args.tokens} tokens; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
