"""`python benchmarks/fuzz.py --help`: runs pp_lab.bench.fuzz (its docstring says what it does)."""
from pp_lab.bench.fuzz import main

if __name__ == "__main__":
    main()
