"""`python benchmarks/paired_rounds.py --help`: runs pp_lab.bench.paired_rounds (its docstring says what it does)."""
from pp_lab.bench.paired_rounds import main

if __name__ == "__main__":
    main()
