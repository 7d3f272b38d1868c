"""`python benchmarks/boundary_error.py --help`: runs pp_lab.bench.boundary_error (its docstring says what it does)."""
from pp_lab.bench.boundary_error import main

if __name__ == "__main__":
    main()
