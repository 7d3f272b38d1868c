"""`python benchmarks/ptxas.py --help`: runs pp_lab.bench.ptxas (its docstring says what it does)."""
from pp_lab.bench.ptxas import main

if __name__ == "__main__":
    main()
