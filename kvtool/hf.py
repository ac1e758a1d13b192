"""kvtool files in and out of Hugging Face transformers (`kvtool/integrations/hf/api.py`).

    import kvtool.hf

    cache, input_ids = kvtool.hf.to_cache("notes.kvc", model)   # the cache holds all but the last token
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    out = kvtool.hf.generate(model, "notes.kvc", max_new_tokens=20)   # the same, in one call
    kvtool.hf.from_cache(cache, token_ids, "out.kvc", model)   # a transformers cache to a kvtool file

Importing this module imports transformers (and torch); `import kvtool` does not.
"""

from .integrations.hf.api import CachedPrompt, SavedCache, from_cache, generate, to_cache

__all__ = ["CachedPrompt", "SavedCache", "from_cache", "generate", "to_cache"]
