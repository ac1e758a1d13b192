"""A vLLM request's store keys: besides its tokens, everything that makes its KV differ or must keep
it apart (format-spec/store.md §3): the connector's namespace, the request's cache salt (a tenant's
secret: never logged), its LoRA adapter (name and a digest of the adapter's files), its multimodal
inputs and its prompt embeddings. Two requests whose keys differ never share a stored chunk.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...engine.weights_digest import weights_digest
from ...errors import KvtoolError
from ...store.names import ExtraKeys, MultimodalKey


class UnusableKeys(Exception):
    """A request whose keys cannot be built (its adapter's files cannot be read, a key is
    malformed): it neither loads nor saves. The message never holds the cache salt."""


@dataclass(frozen=True)
class RequestFacts:
    """What decides a request's keys, copied off vLLM's Request on the scheduler's thread: the
    lookup thread that turns it into keys never touches the live Request."""

    req_id: str
    tokens: list[int]  # the prompt's token ids (zeros where vLLM was given embeddings instead)
    cache_salt: str = field(default="", repr=False)
    adapter: str = ""  # the LoRA adapter's name
    adapter_path: str = ""  # where its files are (vLLM's lora_path)
    multimodal: tuple[MultimodalKey, ...] = ()
    prompt_embeds: Any = field(default=None, repr=False)  # a [T, H] tensor, or None


def request_facts(request) -> RequestFacts:
    """The facts of a vLLM 0.32 `Request`."""
    lora = request.lora_request
    return RequestFacts(req_id=request.request_id, tokens=prompt_tokens(request),
                        cache_salt=request.cache_salt or "",
                        adapter=lora.lora_name if lora is not None else "",
                        adapter_path=(lora.lora_path or "") if lora is not None else "",
                        multimodal=tuple(MultimodalKey(f.identifier, f.mm_position.offset, f.mm_position.length)
                                         for f in request.mm_features or ()),
                        prompt_embeds=request.prompt_embeds)


def prompt_tokens(request) -> list[int]:
    """The prompt's token ids; for a prompt given as embeddings, vLLM's placeholder ids (zeros):
    the embeddings' digests, in the keys, tell such prompts apart."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    return list(request.all_token_ids[:request.num_prompt_tokens])


class AdapterDigests:
    """"sha256:..." of LoRA adapters' files (kvtool's weights digest over every file of the adapter's
    folder), kept per path while the files' sizes and times stay the same: a changed adapter at the
    same path gets a new digest, so it never reuses the old adapter's KV. Safe from several threads."""

    def __init__(self):
        self._known: dict[str, tuple[tuple, str]] = {}  # path -> (files' stamp, digest)
        self._lock = threading.Lock()

    def digest(self, path: str) -> str:
        """The digest of the adapter at `path`; OSError when its files cannot be read."""
        folder = Path(path).expanduser()
        stamp = _stamp(folder)
        with self._lock:
            known = self._known.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        digest = weights_digest(folder, [name for name, _, _ in stamp])
        with self._lock:
            self._known[path] = (stamp, digest)
        return digest


def _stamp(folder: Path) -> tuple:
    """(name, size, mtime) of each file of an adapter's folder, in name order; OSError when there
    are none (vLLM names a folder; a Hub id it downloaded itself is not one kvtool can read)."""
    entries = sorted((p.name, p.stat()) for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not entries:
        raise FileNotFoundError(f"no files in {folder}")
    return tuple((name, st.st_size, st.st_mtime_ns) for name, st in entries)


def extra_keys(facts: RequestFacts, namespace: str, digests: AdapterDigests) -> ExtraKeys:
    """The request's ExtraKeys; UnusableKeys (naming the adapter, never the salt) when they
    cannot be built."""
    digest = ""
    if facts.adapter:
        try:
            digest = digests.digest(facts.adapter_path)
        except OSError as err:
            raise UnusableKeys(f"LoRA adapter {facts.adapter!r} at {facts.adapter_path} cannot be read "
                               f"({err.strerror or type(err).__name__})") from None
    try:
        return ExtraKeys(namespace=namespace, cache_salt=facts.cache_salt, adapter=facts.adapter,
                         adapter_digest=digest, multimodal=facts.multimodal, prompt_embeds=facts.prompt_embeds)
    except KvtoolError as err:  # kvtool's messages name a key, never its value
        raise UnusableKeys(str(err)) from None


def keys_up_to(keys: ExtraKeys, end: int) -> ExtraKeys:
    """`keys` for the tokens [0, end) only: prompt embeddings cut to their first `end` rows, so that
    a load or save sent to the worker carries no more of them than it names chunks with."""
    if keys.prompt_embeds is None or len(keys.prompt_embeds) <= end:
        return keys
    rows = keys.prompt_embeds[:end]
    # a copy: a pickled view would carry every row of the tensor it views
    return dataclasses.replace(keys, prompt_embeds=rows.clone() if hasattr(rows, "clone") else rows.copy())
