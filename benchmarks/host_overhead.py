"""`python benchmarks/host_overhead.py --help`: runs pp_lab.bench.host_overhead (its docstring says what it does)."""
from pp_lab.bench.host_overhead import main

if __name__ == "__main__":
    main()
