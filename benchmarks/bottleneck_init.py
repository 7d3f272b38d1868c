"""`python benchmarks/bottleneck_init.py --help`: runs pp_lab.bench.bottleneck_init (its docstring says what it does)."""
from pp_lab.bench.bottleneck_init import main

if __name__ == "__main__":
    main()
