"""One vLLM engine process serving one prompt with KVToolConnector (run by test_vllm_connector.py).

argv: store URL, codec, prompt file, [load failure policy]; env MNBT: max_num_batched_tokens.
Prints one line: RESULT {json}."""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtool.engine.default_model import default_model_path

    store, codec, prompt_file = sys.argv[1:4]
    policy = sys.argv[4] if len(sys.argv) > 4 else "fail"
    config = KVTransferConfig(kv_connector="KVToolConnector", kv_role="kv_both",
                              kv_connector_module_path="kvtool.integrations.vllm",
                              kv_connector_extra_config={"store": store, "codec": codec},
                              kv_load_failure_policy=policy)
    extra = {"max_num_batched_tokens": int(os.environ["MNBT"])} if os.environ.get("MNBT") else {}
    llm = LLM(model=str(default_model_path()), dtype="float32", max_model_len=2048, enforce_eager=True,
              kv_transfer_config=config, enable_prefix_caching=False, **extra)
    prompt = open(prompt_file).read()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    print("RESULT " + json.dumps({"num_cached_tokens": out.num_cached_tokens, "prompt_tokens": len(out.prompt_token_ids),
                                  "prompt_token_ids": list(out.prompt_token_ids), "text": out.outputs[0].text}))


if __name__ == "__main__":
    main()
