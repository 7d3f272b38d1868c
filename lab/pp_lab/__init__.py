"""The pp_compress lab: the models, data, training loop, studies and benchmarks behind recipes/, eval/ and
benchmarks/ (their thin entry scripts). Not part of the pp_compress library: install it with `make setup`, or
`pip install -e ".[deepspeed,dev]" -e lab` beside torch."""
