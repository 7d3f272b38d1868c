"""`python benchmarks/tp_bytes.py --help`: runs pp_lab.bench.tp_bytes (its docstring says what it does)."""
from pp_lab.bench.tp_bytes import main

if __name__ == "__main__":
    main()
