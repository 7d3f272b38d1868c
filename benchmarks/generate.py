"""`python benchmarks/generate.py --help`: runs pp_lab.bench.generate (its docstring says what it does)."""
from pp_lab.bench.generate import main

if __name__ == "__main__":
    main()
