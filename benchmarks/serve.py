"""`python benchmarks/serve.py --help`: runs pp_lab.bench.serve (its docstring says what it does)."""
from pp_lab.bench.serve import main

if __name__ == "__main__":
    main()
