"""`python benchmarks/e2e.py --help`: runs pp_lab.bench.e2e (its docstring says what it does)."""
from pp_lab.bench.e2e import main

if __name__ == "__main__":
    main()
