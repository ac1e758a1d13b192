import os, sys, time, json
T0 = time.time()
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

MODEL = os.path.expanduser("~/.cache/kvtool/models/SmolLM2-135M-Instruct")
PROMPT = ("The history of computing is long and varied. " * 2 +
          " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(45)))

def main():
    connector = sys.argv[1] if len(sys.argv) > 1 else "ExampleConnector"
    module = (sys.argv[2] or None) if len(sys.argv) > 2 else None
    store = sys.argv[3] if len(sys.argv) > 3 else "/tmp/vllm-probe/kv"
    ktc = KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                           kv_connector_module_path=module,
                           kv_connector_extra_config={"shared_storage_path": store})
    t = time.time()
    llm = LLM(model=MODEL, dtype="float32", max_model_len=2048, enforce_eager=True,
              kv_transfer_config=ktc, enable_prefix_caching=False,
              **({"max_num_batched_tokens": int(os.environ["MNBT"])} if os.environ.get("MNBT") else {}))
    t_init = time.time() - t
    tok = llm.get_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    t = time.time()
    out = llm.generate([PROMPT], sp)
    t_gen = time.time() - t
    print("RESULT", json.dumps({"prompt_tokens": len(ids), "import_s": round(t-t_init-T0+ (t - t) ,1) if False else None,
          "engine_init_s": round(t_init, 1), "generate_s": round(t_gen, 2),
          "num_cached_tokens": out[0].num_cached_tokens,
          "text": out[0].outputs[0].text}))

if __name__ == "__main__":
    main()
