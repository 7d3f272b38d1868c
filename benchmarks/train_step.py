"""`python benchmarks/train_step.py --help`: runs pp_lab.bench.train_step (its docstring says what it does)."""
from pp_lab.bench.train_step import main

if __name__ == "__main__":
    main()
