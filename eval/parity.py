"""`python eval/parity.py --help`: runs pp_lab.eval.parity (its docstring says what it does)."""
from pp_lab.eval.parity import main

if __name__ == "__main__":
    main()
