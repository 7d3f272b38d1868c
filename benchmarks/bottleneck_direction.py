"""`python benchmarks/bottleneck_direction.py --help`: runs pp_lab.bench.bottleneck_direction (its docstring says what it does)."""
from pp_lab.bench.bottleneck_direction import main

if __name__ == "__main__":
    main()
