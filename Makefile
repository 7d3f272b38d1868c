# The two commands a new user needs:  `make demo`  and  `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned, so that nothing pulls a CUDA build on CPU machines
	$(VPY) -m pip install -q $(TORCH)
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(VPY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev,recipes]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=2 $(VPY) recipes/demo_inprocess.py

test: $(STAMP)
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
