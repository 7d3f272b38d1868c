"""`python benchmarks/vq_search.py --help`: runs pp_lab.bench.vq_search (its docstring says what it does)."""
from pp_lab.bench.vq_search import main

if __name__ == "__main__":
    main()
