"""Store names (format-spec/store.md §3) checked against an independent implementation.

The `spec_*` functions are written from store.md §3 (and §4.1 for one table row) and container.md
§3.1/§4 alone, with hashlib, json and struct only. The tests check (1) every row of store.md's
worked-example table, parsed from the file at test time, against them; (2) kvtool.store.names
against them, on the table's inputs and on seeded random ones; (3) the properties §3 promises.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtool.format.hashing import prefix_hashes
from kvtool.store.names import (ExtraKeys, MultimodalKey, chunk_chain, chunk_name, entry_key,
                                model_key, salt_digest, tensor_name)

STORE_MD = Path(__file__).resolve().parent.parent / "format-spec" / "store.md"


# ---- Independent implementation of store.md §3, from the text only (hashlib, json, struct) ----
def spec_canonical_json(x) -> bytes:  # container.md §3.1: sorted keys, no whitespace, UTF-8 as is
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

def spec_model_key(fingerprint: str, weights_digest: str = "") -> str:
    data = b"kvtool-store/2\x00" + fingerprint.encode("ascii") + b"\x00" + weights_digest.encode("ascii")
    return hashlib.sha256(data).hexdigest()[:32]

def spec_salt_digest(salt: str) -> str:
    return "sha256:" + hashlib.sha256(salt.encode("utf-8")).hexdigest()

def spec_embeds_digest(dtype: str, rows: list[list[float]]) -> str:  # float32 rows only here
    head = spec_canonical_json({"dtype": dtype, "shape": [len(rows), len(rows[0])]})
    body = b"".join(struct.pack(f"<{len(r)}f", *r) for r in rows)
    return hashlib.sha256(head + b"\x00" + body).hexdigest()

def spec_extras(n_tokens, S, namespace="", salt="", adapter="", adapter_digest="", mm=(), embeds=None):
    """X[i] for each whole chunk; `mm` is [(identifier, offset, length)], `embeds` [T][H] floats."""
    xs = []
    for i in range(n_tokens // S):
        lo, hi = i * S, (i + 1) * S
        x = {}
        if namespace: x["namespace"] = namespace
        if salt: x["cache_salt"] = spec_salt_digest(salt)
        if adapter: x["adapter"] = adapter
        if adapter_digest: x["adapter_digest"] = adapter_digest
        over = sorted([ident, off, ln] for ident, off, ln in mm if off < hi and lo < off + ln)
        if over: x["mm"] = over
        if embeds is not None: x["prompt_embeds"] = spec_embeds_digest("float32", embeds[lo:hi])
        xs.append(x)
    return xs

def spec_chain(tokens: list[int], S: int, xs: list[dict] | None = None) -> list[str]:
    """H[i] = SHA-256(H[i-1] || u32le(tokens of chunk i) || E(X[i])), whole chunks only."""
    h, out = bytes(32), []
    for i in range(len(tokens) // S):
        x = xs[i] if xs else {}
        e = b"kvtool-extra/2\x00" + spec_canonical_json(x) if x else b""
        h = hashlib.sha256(h + struct.pack(f"<{S}I", *tokens[i * S:(i + 1) * S]) + e).digest()
        out.append(h.hex())
    return out

def spec_container_chain(tokens: list[int], S: int) -> list[str]:  # container.md §4, ragged tail too
    h, out = bytes(32), []
    for lo in range(0, len(tokens), S):
        h = hashlib.sha256(h + b"".join(struct.pack("<I", t) for t in tokens[lo:lo + S])).digest()
        out.append(h.hex())
    return out

def spec_chunk_name(mkey: str, S: int, h: str) -> str:
    return f"chunks/{mkey}/{S}/{h[:2]}/{h}.kvc"

def spec_entry_key(mkey: str, tokens: list[int], roi: list[int]) -> str:
    data = b"kvtool-entry/1\x00" + mkey.encode("ascii") + struct.pack(f"<{len(tokens)}I", *tokens) + bytes(roi)
    return hashlib.sha256(data).hexdigest()

def spec_tensor_name(key: str) -> str:
    d = hashlib.sha256(key.encode("utf-8")).hexdigest()
    return f"tensors/{d[:2]}/{d}.safetensors"


# The worked example's inputs, as the table states them.
TOKENS, S = [1, 2, 3, 4, 5, 6, 7, 8], 4
SALTED = dict(namespace="team-a", salt="s3cret")
LORA_IMG = dict(adapter="sql-lora", mm=[("img-1f2e", 5, 2)])


def table() -> tuple[str, list[tuple[str, str]]]:
    """(the example model's fingerprint, [(what, value)]) parsed from store.md §3."""
    text = STORE_MD.read_text(encoding="utf-8")
    section = text.split("**Worked example**", 1)[1].split("\n## 4.", 1)[0]
    fp = re.search(r"fingerprint\s+`(sha256:[0-9a-f]{64})`", section).group(1)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [re.split(r"(?<!\\)\|", r.strip())[1:-1] for r in rows[1:]]  # header dropped, \| kept
    return fp, [(w.strip(), v.strip()) for w, v in cells]


def expected_rows(fp: str) -> list[tuple[str, object]]:
    """What each table row must say, in table order: (a phrase of its 'what' cell, value)."""
    mk = spec_model_key(fp)
    plain, salted = spec_chain(TOKENS, S), spec_chain(TOKENS, S, spec_extras(8, S, **SALTED))
    x_lora = spec_extras(8, S, **LORA_IMG)
    lora = spec_chain(TOKENS, S, x_lora)
    cj = lambda x: spec_canonical_json(x).decode()
    embeds_x = spec_extras(8, S, embeds=[[0.0, 0.0]] * 8)
    model_input = b"kvtool-store/2\x00" + fp.encode() + b"\x00"
    # Descriptive rows are compared as whole cells (a 1-tuple), the others as one `value`.
    input_cell = f"the {len(model_input)} bytes `kvtool-store/2` 00 `{fp[:11]}...{fp[-4:]}` 00"
    chunk0_bytes = "32 zero bytes, then `" + " ".join(struct.pack("<I", t).hex() for t in TOKENS[:S]) + "`"
    return [
        ("model key input", (input_cell,)),
        ("model key", mk),
        ('`weights_digest` = `"sha256:" + "ab" * 32`', spec_model_key(fp, "sha256:" + "ab" * 32)),
        ("no extra keys: chunk 0 hashes", (chunk0_bytes,)),
        ("`H[0]`", plain[0]),
        ("chunk 0's name", spec_chunk_name(mk, S, plain[0])),
        ("`H[1]` = SHA-256(`H[0]` \\|\\| u32le 5, 6, 7, 8)", plain[1]),
        ("container chunk's own `prefix_hash`", spec_container_chain(TOKENS[4:], S)[0]),  # §4.1
        ("namespace `team-a`, cache salt `s3cret`: `X[0]` = `X[1]`", cj(spec_extras(8, S, **SALTED)[1])),
        ("`H[0]`", salted[0]),
        ("`H[1]`", salted[1]),
        ("adapter `sql-lora`, an image `img-1f2e` at offset 5, length 2: `X[0]`", cj(x_lora[0])),
        ("`X[1]`", cj(x_lora[1])),
        ("`H[0]`", lora[0]),
        ("`H[1]`", lora[1]),
        ("adapter `sql-lora` with `adapter_digest`", spec_chain(TOKENS, S, spec_extras(
            8, S, adapter="sql-lora", adapter_digest="sha256:" + "cd" * 32))[0]),
        ("prompt embeddings of float32 zeros `[8, 2]`: `X[0]`", cj(embeds_x[0])),
        ("`H[0]`", spec_chain(TOKENS, S, embeds_x)[0]),
        ("entry key of tokens `[1, 2, 3, 4]`, roi `[1, 1, 0, 1]`", spec_entry_key(mk, TOKENS[:4], [1, 1, 0, 1])),
        ("block prefix `P(1, 2)`", hashlib.sha256(bytes.fromhex(plain[0]) + struct.pack("<2I", 5, 6)).hexdigest()),
        ("tensor name of key `layer0/k`", spec_tensor_name("layer0/k")),
    ]


def test_worked_example_table_matches_the_spec_text():
    fp, rows = table()
    expected = expected_rows(fp)
    assert len(rows) == len(expected), f"table has {len(rows)} rows, test knows {len(expected)}: {rows}"
    bad = []
    for (what, value), (phrase, want) in zip(rows, expected):
        assert phrase in what, f"table row {what!r} is not the expected {phrase!r} (reordered?)"
        cell = want[0] if isinstance(want, tuple) else f"`{want}`"
        if value != cell:
            bad.append(f"row {what!r}: table says {value}, spec text gives {cell}")
    assert not bad, "spec bug: worked example disagrees with §3's text:\n" + "\n".join(bad)


def kv_chain(tokens, S, **kw):
    """kvtool's chain for the same inputs as spec_extras' keywords."""
    emb = kw.pop("embeds", None)
    ek = ExtraKeys(namespace=kw.get("namespace", ""), cache_salt=kw.get("salt", ""), adapter=kw.get("adapter", ""),
                   adapter_digest=kw.get("adapter_digest", ""),
                   multimodal=tuple(MultimodalKey(*m) for m in kw.get("mm", ())),
                   prompt_embeds=None if emb is None else np.array(emb, dtype=np.float32))
    return chunk_chain(np.array(tokens), S, ek)


def assert_agree(tokens, S, **kw):
    xs = spec_extras(len(tokens), S, **kw)
    hs = spec_chain(tokens, S, xs)
    links = kv_chain(tokens, S, **kw)
    assert [l.prefix_hash for l in links] == hs
    assert [l.start for l in links] == [i * S for i in range(len(hs))]
    assert [l.parent.hex() for l in links] == (["0" * 64] + hs)[: len(hs)]
    assert [l.extra or {} for l in links] == xs
    return hs


def test_kvtool_agrees_on_the_worked_example():
    fp, _ = table()
    mk = spec_model_key(fp)
    assert model_key({"fingerprint": fp}) == mk
    wd = "sha256:" + "ab" * 32
    assert model_key({"fingerprint": fp, "weights_digest": wd}) == spec_model_key(fp, wd)
    for kw in ({}, SALTED, LORA_IMG):
        hs = assert_agree(TOKENS, S, **kw)
        assert [chunk_name(mk, S, h) for h in hs] == [spec_chunk_name(mk, S, h) for h in hs]
    assert salt_digest("s3cret") == spec_salt_digest("s3cret")
    roi = [1, 1, 0, 1]
    assert entry_key(mk, np.array(TOKENS[:4]), np.array(roi, dtype=bool)) == spec_entry_key(mk, TOKENS[:4], roi)
    assert tensor_name("layer0/k") == spec_tensor_name("layer0/k")


def f32(row):
    return list(struct.unpack(f"<{len(row)}f", struct.pack(f"<{len(row)}f", *row)))


def test_kvtool_agrees_on_prompt_embeds():
    # [10, 2] float32 rows (values rounded to float32 first), S = 4: two whole chunks, 2 rows left.
    emb = [f32([i * 0.5 - 3.25, -i / 7.0]) for i in range(10)]
    assert_agree(list(range(100, 110)), 4, embeds=emb, namespace="ns")


@pytest.mark.parametrize("seed", range(25))
def test_kvtool_agrees_on_random_inputs(seed):
    rng = random.Random(seed)
    S = rng.choice([1, 2, 3, 4, 7, 16])
    tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 5 * S + 3))]
    kw = {}
    if rng.random() < 0.5: kw["namespace"] = rng.choice(["team-a", "équipe-ß", "名前", "a\"b\\c\n"])
    if rng.random() < 0.5: kw["salt"] = rng.choice(["s3cret", "sel-é", ""])
    if rng.random() < 0.5: kw["adapter"] = rng.choice(["sql-lora", "lora/ü"])
    if rng.random() < 0.3: kw["adapter_digest"] = "sha256:" + hashlib.sha256(bytes([seed])).hexdigest()
    if rng.random() < 0.6 and tokens:
        ids = ["img-b", "img-a", "img-a2"]  # several images, to check the `mm` sort
        kw["mm"] = [(rng.choice(ids), rng.randrange(len(tokens)), rng.randrange(1, 2 * S + 2))
                    for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.3 and tokens:
        kw["embeds"] = [f32([rng.uniform(-9, 9) for _ in range(3)]) for _ in tokens]
    assert_agree(tokens, S, **kw)


def test_extra_keys_separate_owners():
    mk = spec_model_key("sha256:" + "0" * 64)
    names = lambda **kw: [chunk_name(mk, S, l.prefix_hash) for l in kv_chain(TOKENS, S, **kw)]
    base = names()
    for kw in (dict(salt="a"), dict(salt="b"), dict(namespace="x"), dict(namespace="y"),
               dict(adapter="l1"), dict(adapter="l2"), dict(adapter_digest="sha256:" + "1" * 64),
               dict(mm=[("img-1", 3, 2)]), dict(mm=[("img-2", 3, 2)])):
        other = names(**kw)
        assert all(a != b for a, b in zip(base, other)), kw  # every chunk of it differs from no-extras
        assert len(other) == len(base)
    for a, b in [("salt", ("a", "b")), ("namespace", ("x", "y")), ("adapter", ("l1", "l2"))]:
        assert all(p != q for p, q in zip(names(**{a: b[0]}), names(**{a: b[1]}))), a
    one, two = names(mm=[("img-1", 3, 2)]), names(mm=[("img-2", 3, 2)])  # overlaps chunks 0 and 1
    assert one[0] != two[0] and one[1] != two[1]
    late = names(mm=[("img-1", 5, 2)])  # only chunk 1: chunk 0 is shared, chunk 1 is not
    assert late[0] == base[0] and late[1] != base[1]
    edge = kv_chain(TOKENS, S, mm=[("img-1", 2, 2)])  # tokens [2, 4): ends at chunk 1's start
    assert "mm" in edge[0].extra and "mm" not in (edge[1].extra or {})


def test_no_extra_keys_is_the_container_chain():
    rng = random.Random(7)
    for n, S in [(8, 4), (10, 3), (1, 1), (300, 256), (0, 2)]:
        tokens = [rng.randrange(2**32) for _ in range(n)]
        spec = spec_container_chain(tokens, S)
        whole = spec[: n // S]  # the store names whole chunks only
        assert [l.prefix_hash for l in chunk_chain(np.array(tokens), S, ExtraKeys())] == whole
        assert spec_chain(tokens, S) == whole
        assert prefix_hashes(np.array(tokens, dtype=np.uint32), S) == spec


def test_block_prefixes_are_links_of_fewer_tokens():
    """store.md §3 "Block prefixes": P(i, m) is hashed as a link of the first m tokens of the
    position, with the extra keys of those tokens; P(i, S) would be H[i]."""
    import numpy as np

    from kvtool.store.names import ExtraKeys, MultimodalKey, block_links, chunk_chain

    tokens = np.array(TOKENS)
    chain = chunk_chain(tokens, S)
    got = block_links(tokens, 4, bytes.fromhex(chain[0].prefix_hash), S, 2)
    assert [(b.tokens, b.prefix_hash) for b in got] == [
        (2, hashlib.sha256(bytes.fromhex(spec_chain(TOKENS, S)[0]) + struct.pack("<2I", 5, 6)).hexdigest())]
    assert [b.tokens for b in block_links(tokens, 0, bytes(32), S, 1)] == [1, 2, 3]
    img = ExtraKeys(multimodal=(MultimodalKey("img-1f2e", 5, 2),))  # overlaps tokens 5-6: not the first one
    first = block_links(tokens, 4, bytes.fromhex(chunk_chain(tokens, S, img)[0].prefix_hash), S, 1, img)
    assert first[0].extra == {} and first[1].extra == {"mm": [["img-1f2e", 5, 2]]}
    assert block_links(tokens, 0, bytes(32), S, 1, ExtraKeys(prompt_embeds=np.zeros((8, 2)))) == []
