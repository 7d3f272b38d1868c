"""`python benchmarks/ops.py --help`: runs pp_lab.bench.ops (its docstring says what it does)."""
from pp_lab.bench.ops import main

if __name__ == "__main__":
    main()
