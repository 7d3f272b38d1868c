"""`python benchmarks/pipeline_bytes.py --help`: runs pp_lab.bench.pipeline_bytes (its docstring says what it does)."""
from pp_lab.bench.pipeline_bytes import main

if __name__ == "__main__":
    main()
