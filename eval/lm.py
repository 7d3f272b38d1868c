"""`python eval/lm.py --help`: runs pp_lab.eval.lm (its docstring says what it does)."""
from pp_lab.eval.lm import main

if __name__ == "__main__":
    main()
