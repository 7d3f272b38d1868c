"""`python benchmarks/window_noise.py --help`: runs pp_lab.bench.window_noise (its docstring says what it does)."""
from pp_lab.bench.window_noise import main

if __name__ == "__main__":
    main()
