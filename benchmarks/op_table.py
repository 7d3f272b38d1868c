"""`python benchmarks/op_table.py --help`: runs pp_lab.bench.op_table (its docstring says what it does)."""
from pp_lab.bench.op_table import main

if __name__ == "__main__":
    main()
