"""The operations: what kvtool's commands do, as functions that return typed results.

This layer is kvtool's public Python API (re-exported as `kvtool.<name>`); the CLI
only parses options, calls one of these and renders its result. Below it lie the
engine, the connectors, the container format and the codecs; nothing below
imports it.

- `capture`, `capture_prompt` (capture.py): a model run's KV into a file
- `replay` (replay.py): a file back into the engine, continued and compared
- `verify` (verify.py), `inspect` (inspect.py): prove a file intact, show what it holds
- `compress` (compress.py), `dump` (dump.py): re-encode, export
- `info` (info.py): versions and backends

`capture` and `replay` run kvtool's engine, or with `engine="hf"` a transformers model
(`kvtool.integrations.hf`, imported only then), through one interface
(`kvtool.engine.protocol.Engine`; `engines.py` chooses the engine and adapts kvtool's runner).
"""
