"""`python benchmarks/throttle.py --help`: runs pp_lab.bench.throttle (its docstring says what it does)."""
from pp_lab.bench.throttle import main

if __name__ == "__main__":
    main()
