"""kvtool with Hugging Face transformers: the only package of kvtool's that imports transformers.

- `api.py`: kvtool files (or a store's prefix, or a dump) to a transformers cache ready for
  `generate` and back (`to_cache`, `from_cache`, `generate`), public as `kvtool.hf`
- `models.py`: a transformers model as kvtool sees it: identity (fingerprint, config digest,
  weights digest), tokenizer, and whether its cache is plain K/V per layer (refused otherwise)
- `caches.py`: KV between a transformers cache and KV_BLOBs through the paged connector (the
  contiguous cache is one block of a paged buffer)
- `runs.py`: the model run for `capture --engine hf` (prefill chunk by chunk) and
  `replay --engine hf` (greedy `generate`, teacher-forced logits)
- `engine.py`: a transformers model behind the interface of kvtool's operations
  (`kvtool.engine.protocol.Engine`): `HFEngine`, what `--engine hf` runs

Imported only where transformers is asked for (`--engine hf`, `kvtool.hf`): `kvtool` itself
never imports it.
"""
