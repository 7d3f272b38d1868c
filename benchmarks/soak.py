"""`python benchmarks/soak.py --help`: runs pp_lab.bench.soak (its docstring says what it does)."""
from pp_lab.bench.soak import main

if __name__ == "__main__":
    main()
