"""`python benchmarks/bottleneck_gap.py --help`: runs pp_lab.bench.bottleneck_gap (its docstring says what it does)."""
from pp_lab.bench.bottleneck_gap import main

if __name__ == "__main__":
    main()
