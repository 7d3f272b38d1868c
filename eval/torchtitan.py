"""`python eval/torchtitan.py --help`: runs pp_lab.eval.torchtitan (its docstring says what it does)."""
from pp_lab.eval.torchtitan import main

if __name__ == "__main__":
    main()
