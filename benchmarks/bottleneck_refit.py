"""`python benchmarks/bottleneck_refit.py --help`: runs pp_lab.bench.bottleneck_refit (its docstring says what it does)."""
from pp_lab.bench.bottleneck_refit import main

if __name__ == "__main__":
    main()
