"""kvtool inside other engines. `kvtool.integrations.vllm`: the vLLM KV connector (imports vLLM;
nothing here is imported by the rest of kvtool)."""
